#!/usr/bin/env python3
"""PyTorch twin of bench/bench_nn_pool.cpp: the same ops, shapes, dtypes and timing method (random
inputs, warm-up, `reps` calls back to back with a CUDA event between consecutive calls, median ms),
printing the same BENCH lines.

Usage: python3 bench/bench_nn_pool_torch.py [--reps N] [--warmup N]
"""
import argparse
import json

from bench_timing import median_ms


def emit(name, fn, torch, reps, warmup):
    try:
        ms = median_ms(torch, fn, reps, warmup)
        print("BENCH " + json.dumps({"name": name, "value": float(f"{ms:.4g}"), "unit": "ms", "ms": round(ms, 4)}),
              flush=True)
    except Exception as e:  # noqa: BLE001 - reported, the run goes on
        print("BENCH " + json.dumps({"name": name, "error": str(e)}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F
    if not torch.cuda.is_available():
        print("# bench_nn_pool_torch: no CUDA device")
        return
    dev = "cuda"
    print(f"# bench_nn_pool_torch: PyTorch {torch.__version__}, median of {a.reps} calls after {a.warmup} warm-up")

    for n, v in ((8192, 32000), (4096, 128256)):
        x = torch.randn(n, v, device=dev, dtype=torch.bfloat16, requires_grad=True)
        t = torch.randint(0, v, (n,), device=dev)
        shape = f"{n}x{v}"

        def fwd():
            with torch.no_grad():
                F.cross_entropy(x, t)

        def fwdbwd():
            x.grad = None
            F.cross_entropy(x, t).backward()

        emit(f"cross_entropy_bf16_fwd_{shape}", fwd, torch, a.reps, a.warmup)
        emit(f"cross_entropy_bf16_fwdbwd_{shape}", fwdbwd, torch, a.reps, a.warmup)
        del x, t

    layers = [
        ("max_pool2d_3x3s2p1", lambda x: F.max_pool2d(x, 3, 2, 1)),
        ("avg_pool2d_3x3s2p1", lambda x: F.avg_pool2d(x, 3, 2, 1)),
        ("upsample_nearest_2x", lambda x: F.interpolate(x, scale_factor=2.0, mode="nearest")),
        ("upsample_bilinear_2x", lambda x: F.interpolate(x, scale_factor=2.0, mode="bilinear", align_corners=False)),
    ]
    for name, f in layers:
        x = torch.randn(32, 256, 64, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
        with torch.no_grad():
            gout = torch.randn_like(f(x))

        def fwd(f=f, x=x):
            with torch.no_grad():
                f(x)

        def fwdbwd(f=f, x=x, gout=gout):
            x.grad = None
            f(x).backward(gout)

        emit(f"{name}_bf16_fwd", fwd, torch, a.reps, a.warmup)
        emit(f"{name}_bf16_fwdbwd", fwdbwd, torch, a.reps, a.warmup)


if __name__ == "__main__":
    main()
