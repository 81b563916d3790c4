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
from bench_timing import emit_rate, median_ms, twin_start


def main():
    start = twin_start("bench_accum_torch", __doc__.splitlines()[0])
    if start is None:
        return 0
    args, torch, dev = start
    import torch.nn.functional as F
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
    emit_rate("accum_dit_residual_bwd", gbps, "GB/s", ms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
