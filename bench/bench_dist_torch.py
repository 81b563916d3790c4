"""PyTorch twin of apps/diffusion/tools/dist_bench.cpp: weak scaling of a DiT training step with
torch DistributedDataParallel (bucket_cap_mb=25), per-GPU batch fixed, bf16 autocast, AdamW,
random data, median step time from CUDA events. Same BENCH names as the FLAME side.

    python3 bench/bench_dist_torch.py --batch 64                    # one GPU
    torchrun --nproc-per-node 2 bench/bench_dist_torch.py --batch 64
"""
import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "apps", "diffusion", "reference"))
from dit import DiT, dit_config  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dit-s")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    a = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    if world > 1:
        try:
            dist.init_process_group("nccl", device_id=dev)
        except TypeError:  # torch < 2.3
            dist.init_process_group("nccl")
    torch.manual_seed(0)
    model = DiT(dit_config(a.model)).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local], bucket_cap_mb=25) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    g = torch.Generator(device=dev).manual_seed(1234 + rank)
    c = model.config
    B = a.batch
    x0 = torch.randn(B, c.in_channels, c.input_size, c.input_size, device=dev, generator=g)
    noise = torch.randn(B, c.in_channels, c.input_size, c.input_size, device=dev, generator=g)
    t = torch.rand(B, device=dev, generator=g)
    y = torch.randint(0, c.num_classes, (B,), device=dev, generator=g)
    tb = t.view(B, 1, 1, 1)
    xt = x0 * (1 - tb) + noise * tb
    target = noise - x0
    times = []
    for s in range(a.warmup + a.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = ddp(xt, t, y)
        loss = F.mse_loss(out.float(), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        end.record()
        end.synchronize()
        if s >= a.warmup:
            times.append(start.elapsed_time(end))
    ms = statistics.median(times)
    if rank == 0:
        print("BENCH " + json.dumps({"name": f"ddp_step/{a.model}/b{B}_per_gpu/gpus{world}", "impl": "torch",
                                     "ms": round(ms, 3), "images_per_s": round(B * world / (ms / 1000), 1),
                                     "gpus": world}), flush=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
