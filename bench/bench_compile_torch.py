#!/usr/bin/env python3
"""PyTorch twin of bench/bench_compile.cpp: the DiT's elementwise chains in bf16 (modulate, gated
residual, bias + gelu_tanh, silu * x) on [256, 196, 384] / [50176, 384], forward and forward +
backward, for PyTorch eager ("torch_eager") and torch.compile ("torch_compile"); same names,
shapes, byte counts and timing (CUDA events between back-to-back calls, warm-up excluded (it
includes torch.compile's compilation), median). Gradients come from torch.autograd.grad with the
given output gradient, as FLAME's backward returns a fresh gradient store.

Usage: python3 bench/bench_compile_torch.py [--reps N] [--warmup N]
"""
import math

from bench_timing import emit_rate, median_ms, twin_start


def main():
    start = twin_start("bench_compile_torch", __doc__.splitlines()[0], ", bf16")
    if start is None:
        return 0
    args, torch, dev = start
    import torch.nn.functional as F
    B, T, D = 256, 196, 384
    N = B * T
    cases = [
        ("modulate", [(B, T, D), (B, 1, D), (B, 1, D)], (B, T, D), lambda x, s, b: x * (1 + s) + b),
        ("gated_residual", [(B, T, D), (B, 1, D), (B, T, D)], (B, T, D), lambda x, g, y: x + g * y),
        ("bias_gelu_tanh", [(N, D), (D,)], (N, D), lambda x, b: F.gelu(x + b, approximate="tanh")),
        ("silu_mul", [(N, D), (N, D)], (N, D), lambda a, b: F.silu(a) * b),
    ]
    for name, shapes, out_shape, fn in cases:
        ins = [torch.randn(s, device=dev).to(torch.bfloat16) for s in shapes]
        in_bytes = sum(math.prod(s) * 2 for s in shapes)
        out_bytes = math.prod(out_shape) * 2
        dy = torch.randn(out_shape, device=dev).to(torch.bfloat16)
        fwd_bytes = in_bytes + out_bytes
        bwd_bytes = fwd_bytes + in_bytes + out_bytes + in_bytes
        grad_ins = [t.detach().clone().requires_grad_() for t in ins]
        for mode, bytes_ in (("fwd", fwd_bytes), ("fwdbwd", bwd_bytes)):
            # A fresh compile per mode (no guard flip between grad modes on one cache entry),
            # static shapes, the whole function as one graph; warm-up long enough to include the
            # forward and (lazily compiled) backward graphs. The counters line shows recompiles.
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            compiled = torch.compile(fn, fullgraph=True, dynamic=False)
            for variant, f in (("torch_eager", fn), ("torch_compile", compiled)):
                if mode == "fwd":
                    def run():
                        with torch.no_grad():
                            f(*ins)
                else:
                    def run():
                        y = f(*grad_ins)
                        torch.autograd.grad(y, grad_ins, dy)
                warm = args.warmup + (10 if variant == "torch_compile" else 2)
                ms = median_ms(torch, run, args.reps, warm)
                emit_rate(f"compile_{name}_{mode}_{variant}", bytes_ / (ms * 1e-3) / 1e9, "GB/s", ms)
            c = torch._dynamo.utils.counters
            print(f"# {name}_{mode}: dynamo frames {dict(c['frames'])}, stats {dict(c['stats'])}, "
                  f"graph breaks {sum(c['graph_break'].values())}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
