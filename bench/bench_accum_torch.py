#!/usr/bin/env python3
"""PyTorch twin of bench/bench_accum.cpp: the backward of the DiT block's residual pattern at dit-s
B256 under bf16 autocast, h = x + gate * (layer_norm(x) * (1 + scale) + shift), with x f32
[256, 196, 384] (x = x0 * 1.25) and the modulation a bf16 [256, 3 * 384] tensor in chunks; the
adaLN output is bf16 as FLAME's fused op returns it. Timed: the backward alone on a retained graph
(torch.autograd.grad, CUDA events between back-to-back calls, warm-up, median). GB/s counts the
same 30 bytes per element as the FLAME side. PyTorch always adds x's two gradient contributions
(there is no unfused variant to switch to, so only accum_dit_residual_bwd is printed).

Usage: python3 bench/bench_accum_torch.py [--reps N] [--warmup N]
"""
import argparse
import json

from bench_timing import median_ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F
    if not torch.cuda.is_available():
        print("# bench_accum_torch: no CUDA device; nothing to measure")
        return 0
    dev = torch.device("cuda", 0)
    print(f"# bench_accum_torch: PyTorch {torch.__version__} on {torch.cuda.get_device_name(0)}, "
          f"reps {args.reps}, warm-up {args.warmup}", flush=True)
    b, t, d = 256, 196, 384
    x0 = (torch.randn(b, t, d, device=dev) * 2.0 + 0.5).requires_grad_()
    m = (torch.randn(b, 3 * d, device=dev) * 0.5).to(torch.bfloat16).requires_grad_()
    dh = torch.randn(b, t, d, device=dev)
    shift, scale, gate = (c[:, None, :] for c in m.chunk(3, 1))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        x = x0 * 1.25
        y = (F.layer_norm(x.float(), (d,), eps=1e-6) * (1 + scale.float()) + shift.float()).to(torch.bfloat16)
        h = x + gate * y
    ms = median_ms(torch, lambda: torch.autograd.grad(h, [x0, m], dh, retain_graph=True), args.reps, args.warmup)
    gbps = 30.0 * b * t * d / (ms * 1e-3) / 1e9
    print("BENCH " + json.dumps({"name": "accum_dit_residual_bwd", "value": float(f"{gbps:.4g}"), "unit": "GB/s",
                                 "ms": round(ms, 4)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
