#!/usr/bin/env python3
"""Full fine-tuning of diffusers' FluxTransformer2DModel under PyTorch FSDP2: the twin of
`flux_parity full` (docs/distributed.md, "Full fine-tuning of FLUX-dev on several GPUs").

  torchrun --nproc-per-node 4 apps/diffusion/reference/fsdp_flux.py --config flux-dev \\
      [--latent 128] [--text 512] [--steps 6] [--warmup 2] [--lr 1e-5] [--checkpointing 1]

Needs torch (2.6 or later: torch.distributed.fsdp.fully_shard), diffusers (0.42) and a GPU per rank.
The transformer is built on the meta device, then fully_shard wraps each of its 19 double and 38
single blocks and the root, with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32) over f32
parameters (the precision policy of `flux_parity full --zero 3 --dtype bf16`: bf16 compute, f32
gradient reduction, f32 master weights and AdamW state in shards), materialised on each rank's GPU
with random weights (N(0, 0.02); the values do not change the step's work). Every block's forward is
checkpointed (diffusers' enable_gradient_checkpointing; flame's ZeRO-3 recomputes each block too).
Batch 1 per rank, each rank its own random latents and text (models_flux.make_inputs), mse loss,
torch.optim.AdamW over the shards. Every rank prints one JSON line: the median step time (CUDA
events, parity_common.time_steps) and its peak allocated memory after the warm-up.
NCCL_NVLS_ENABLE=0 is set unless given (NVLink multicast stays off).
"""
import argparse
import json
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models_flux import CONFIGS, make_inputs, run  # noqa: E402  (also turns cuDNN SDPA off, as there)
from parity_common import time_steps  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="flux-dev", choices=sorted(CONFIGS))
    ap.add_argument("--latent", type=int, default=128, help="latent size (1024² images: 128)")
    ap.add_argument("--text", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--checkpointing", type=int, default=1, help="1: every block's forward recomputed in backward")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from diffusers import FluxTransformer2DModel
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)

    with torch.device("meta"):
        model = FluxTransformer2DModel(**CONFIGS[args.config])
    if args.checkpointing:
        model.enable_gradient_checkpointing()
    buffers = [n for n, _ in model.named_buffers()]
    if buffers:  # to_empty would leave them uninitialised
        raise SystemExit(f"fsdp_flux: the model has buffers this script does not initialise: {buffers}")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # The blocks do not cast their inputs: the root already casts the model's inputs, and a block's
    # cast would make the rotary tables bf16 in the forward but leave them f32 in the checkpoint's
    # recompute (torch.utils.checkpoint then raises on the differing saved tensors).
    block_mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for block in list(model.transformer_blocks) + list(model.single_transformer_blocks):
        fully_shard(block, mp_policy=block_mp)
    fully_shard(model, mp_policy=mp)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + rank)
    with torch.no_grad():
        for p in model.parameters():  # each rank's shard of a DTensor parameter
            p.to_local().normal_(0.0, 0.02, generator=gen)
    elements = sum(p.numel() for p in model.parameters())
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    x = make_inputs(args.config, 1, args.latent, args.latent, args.text, device, torch.bfloat16,
                    args.seed + 10 + rank)
    guidance = CONFIGS[args.config]["guidance_embeds"]

    def step():
        out = run(model, x, guidance)
        loss = F.mse_loss(out.float(), x["target"].float())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t = time_steps(step, args.warmup, args.steps)
    print(json.dumps({"impl": "torch+fsdp2", "work": f"{args.config}_full_step", "rank": rank, "world": world,
                      "checkpointing": bool(args.checkpointing), "latent": args.latent, "text": args.text,
                      **t, "reserved_peak_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3),
                      "parameters": elements, "gpu": torch.cuda.get_device_name()}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
