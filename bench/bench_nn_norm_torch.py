#!/usr/bin/env python3
"""PyTorch twin of bench/bench_nn_norm.cpp: layer_norm, rms_norm and group_norm in bf16, forward and
forward+backward, same shapes, names and timing (CUDA events between back-to-back calls, warm-up,
median). GB/s counts the bytes the op must move (forward: x, y and the affine parameters;
forward+backward adds x, dy and dx and the parameter gradients; group_norm_bf16_bwd: the backward
alone on a retained graph, x, dy, dx and the parameters twice); pct_d2d is that rate over a
256 MiB device-to-device copy timed the same way (norm_d2d_copy). Gradients come from
torch.autograd.grad (no accumulation into .grad), as FLAME's backward returns a fresh store.

--compile wraps each op in torch.compile (default mode; compilation happens in the warm-up) and
marks the lines "impl": "compile" (bench/suite.py's torch.compile column); d2d stays eager.

Usage: python3 bench/bench_nn_norm_torch.py [--reps N] [--warmup N] [--compile]
"""
import argparse
import json

from bench_timing import median_ms


IMPL = "eager"


def emit(name, gbps, ms, d2d):
    print("BENCH " + json.dumps({"name": name, "value": float(f"{gbps:.4g}"), "unit": "GB/s",
                                 "ms": round(ms, 4), "pct_d2d": round(100.0 * gbps / d2d, 1),
                                 "impl": IMPL}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="time each op through torch.compile")
    args = ap.parse_args()
    global IMPL
    IMPL = "compile" if args.compile else "eager"
    import torch
    import torch.nn.functional as F
    if not torch.cuda.is_available():
        print("# bench_nn_norm_torch: no CUDA device; nothing to measure")
        return 0
    dev = torch.device("cuda", 0)
    print(f"# bench_nn_norm_torch: PyTorch {torch.__version__} on {torch.cuda.get_device_name(0)}, "
          f"reps {args.reps}, warm-up {args.warmup}", flush=True)
    reps, warmup = args.reps, args.warmup

    nbytes = 256 << 20
    src = torch.rand(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    ms = median_ms(torch, lambda: dst.copy_(src), reps, warmup)
    d2d = 2.0 * nbytes / (ms * 1e-3) / 1e9
    if not args.compile:  # the same copy either way
        print("BENCH " + json.dumps({"name": "norm_d2d_copy", "value": float(f"{d2d:.4g}"), "unit": "GB/s",
                                     "ms": round(ms, 4), "pct_d2d": 100.0}), flush=True)
    del src, dst

    def run(name, shape, params, bias, op, bwd_alone=False):
        if args.compile:
            op = torch.compile(op)
        x0 = (torch.randn(shape, device=dev) * 2.0 + 0.5).to(torch.bfloat16)
        w = (torch.randn(params, device=dev) * 0.2 + 1.0).to(torch.bfloat16).requires_grad_()
        b = (torch.randn(params, device=dev) * 0.2).to(torch.bfloat16).requires_grad_() if bias else None
        dy = torch.randn(shape, device=dev).to(torch.bfloat16)
        xb = float(x0.numel() * 2)
        pb = float(params * 2 * (2 if bias else 1))
        with torch.no_grad():
            ms = median_ms(torch, lambda: op(x0, w, b), reps, warmup)
        emit(name + "_fwd", (2 * xb + pb) / (ms * 1e-3) / 1e9, ms, d2d)
        x = x0.detach().requires_grad_()
        inputs = [x, w] + ([b] if bias else [])

        def step():
            y = op(x, w, b)
            torch.autograd.grad(y, inputs, dy)

        ms = median_ms(torch, step, reps, warmup)
        emit(name + "_fwdbwd", (5 * xb + 3 * pb) / (ms * 1e-3) / 1e9, ms, d2d)
        if not bwd_alone or IMPL == "compile":
            # torch.compile's backward donates its buffers: a retained graph cannot be replayed.
            return
        y = op(x, w, b)  # the backward alone, on a retained graph
        ms = median_ms(torch, lambda: torch.autograd.grad(y, inputs, dy, retain_graph=True), reps, warmup)
        emit(name + "_bwd", (3 * xb + 2 * pb) / (ms * 1e-3) / 1e9, ms, d2d)

    run("layer_norm_bf16", (32768, 1024), 1024, True, lambda x, w, b: F.layer_norm(x, (1024,), w, b))
    if hasattr(F, "rms_norm"):
        run("rms_norm_bf16", (32768, 1024), 1024, False, lambda x, w, b: F.rms_norm(x, (1024,), w, 1e-6))
    else:
        print("# bench_nn_norm_torch: this PyTorch has no F.rms_norm")
    run("group_norm_bf16", (32, 512, 64, 64), 512, True, lambda x, w, b: F.group_norm(x, 32, w, b),
        bwd_alone=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
