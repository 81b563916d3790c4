#!/usr/bin/env python3
"""PyTorch twin of bench/bench_train_offload.cpp: the rows PyTorch has an equivalent for, same
names, shapes and timing (CUDA events between back-to-back calls, warm-up, median):
offload_pinned_h2d / offload_pinned_d2h (a 256 MiB non_blocking copy from/to pinned memory),
offload_step_plain (forward, backward, SGD with momentum on a stack of 8 residual blocks
x + tanh(Linear(x)), width 2048, batch 4096, f32) and offload_step_activations (the same under
torch.autograd.graph.save_on_cpu(pin_memory=True)), and offload_fwdbwd_plain (forward and
backward only; gradients from torch.autograd.grad, as FLAME's backward returns a fresh store).
Weight streaming and the host optimizer have
no PyTorch counterpart: the FLAME side reports their memory saved and step time alone.
peak_mib is torch.cuda.max_memory_allocated over one step (everything live counted).

Usage: python3 bench/bench_train_offload_torch.py [--reps N] [--warmup N]
"""
import argparse
import json

from bench_timing import median_ms

WIDTH, BLOCKS, BATCH = 2048, 8, 4096


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F
    if not torch.cuda.is_available():
        print("# bench_train_offload_torch: no CUDA device; nothing to measure")
        return 0
    dev = torch.device("cuda", 0)
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"# bench_train_offload_torch: PyTorch {torch.__version__} on {torch.cuda.get_device_name(0)}, "
          f"reps {args.reps}, warm-up {args.warmup}", flush=True)
    reps, warmup = args.reps, args.warmup

    n = (256 << 20) // 4
    host = torch.empty(n, pin_memory=True).fill_(1.0)
    d = torch.empty(n, device=dev)
    for name, fn in (("offload_pinned_h2d", lambda: d.copy_(host, non_blocking=True)),
                     ("offload_pinned_d2h", lambda: host.copy_(d, non_blocking=True))):
        ms = median_ms(torch, fn, reps, warmup)
        print("BENCH " + json.dumps({"name": name, "value": float(f"{(256 << 20) / (ms * 1e-3) / 1e9:.4g}"),
                                     "unit": "GB/s", "ms": round(ms, 4)}), flush=True)
    del host, d

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            return x + torch.tanh(self.fc(x))

    g = torch.Generator().manual_seed(7)
    x = (torch.rand(BATCH, WIDTH, generator=g) * 2 - 1).to(dev)
    target = (torch.rand(BATCH, WIDTH, generator=g) * 2 - 1).to(dev)
    blocks = torch.nn.Sequential(*[Block() for _ in range(BLOCKS)]).to(dev)
    opt = torch.optim.SGD(blocks.parameters(), lr=1e-3, momentum=0.9)

    def step(offload):
        opt.zero_grad(set_to_none=True)
        if offload:
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                loss = F.mse_loss(blocks(x), target)
        else:
            loss = F.mse_loss(blocks(x), target)
        loss.backward()
        opt.step()

    def fwd_bwd():
        loss = F.mse_loss(blocks(x), target)
        torch.autograd.grad(loss, list(blocks.parameters()))

    def peak_mib(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / (1 << 20)

    fb_peak = peak_mib(fwd_bwd)
    ms = median_ms(torch, fwd_bwd, reps, warmup)
    print("BENCH " + json.dumps({"name": "offload_fwdbwd_plain", "value": float(f"{ms:.4g}"), "unit": "ms",
                                 "peak_mib": round(fb_peak, 1), "saved_mib": 0.0}), flush=True)

    step(False)  # momentum buffers exist from here on

    plain_peak = peak_mib(lambda: step(False))
    for name, off in (("offload_step_plain", False), ("offload_step_activations", True)):
        peak = peak_mib(lambda: step(off))
        ms = median_ms(torch, lambda: step(off), reps, warmup)
        print("BENCH " + json.dumps({"name": name, "value": float(f"{ms:.4g}"), "unit": "ms",
                                     "peak_mib": round(peak, 1), "saved_mib": round(plain_peak - peak, 1)}),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
