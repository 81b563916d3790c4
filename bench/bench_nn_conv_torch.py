#!/usr/bin/env python3
"""PyTorch twin of bench/bench_nn_conv.cpp: the same convolutions, shapes, dtype, layouts and timing
(warm-up calls, then `reps` calls back to back with a CUDA event between consecutive calls, median
in ms), printing the same "BENCH {json}" lines.

conv3x3_bf16_{fwd,fwdbwd} and conv3x3_bf16_cl_{fwd,fwdbwd}: F.conv2d, bf16, N=32, 256 -> 256
channels, 64x64, padding 1, no bias; fwdbwd computes the input and weight gradients through
torch.autograd.grad. conv3x3_bf16_cl_fwdbwd_contig_grads also makes those gradients contiguous, as
FLAME's gradient store does for every leaf, to separate that copy from the conv kernels. cuDNN with its default settings (benchmark off), as FLAME uses heuristics.

Usage: python3 bench/bench_nn_conv_torch.py [--reps N] [--warmup N]
"""
import argparse
import json

from bench_timing import median_ms


def emit(name, ms=None, error=None):
    rec = {"name": name}
    if error is not None:
        rec["error"] = error
    else:
        rec.update({"value": float(f"{ms:.4g}"), "unit": "ms", "ms": round(ms, 4)})
    print("BENCH " + json.dumps(rec), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        print(f"# bench_nn_conv_torch: no torch ({e})")
        return
    if not torch.cuda.is_available():
        print("# bench_nn_conv_torch: no CUDA device")
        return
    dev = torch.device("cuda", 0)
    n, c, hw = 32, 256, 64
    print(f"# conv3x3 bf16 N{n} C{c}->{c} {hw}x{hw} pad 1, median of {args.reps} calls, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}")
    for cl in (False, True):
        x = torch.randn(n, c, hw, hw, device=dev, dtype=torch.bfloat16)
        w = torch.randn(c, c, 3, 3, device=dev, dtype=torch.bfloat16) * 0.02
        gy = torch.randn(n, c, hw, hw, device=dev, dtype=torch.bfloat16)
        if cl:
            x = x.contiguous(memory_format=torch.channels_last)
            w = w.contiguous(memory_format=torch.channels_last)
            gy = gy.contiguous(memory_format=torch.channels_last)
        prefix = "conv3x3_bf16_cl_" if cl else "conv3x3_bf16_"

        def fwd():
            with torch.no_grad():
                F.conv2d(x, w, None, 1, 1)

        xg = x.detach().requires_grad_(True)
        wg = w.detach().requires_grad_(True)

        def fwdbwd():
            y = F.conv2d(xg, wg, None, 1, 1)
            torch.autograd.grad(y, (xg, wg), gy)

        def fwdbwd_contig_grads():
            # FLAME's gradient store keeps every leaf gradient contiguous; this mirrors that copy.
            y = F.conv2d(xg, wg, None, 1, 1)
            for g in torch.autograd.grad(y, (xg, wg), gy):
                g.contiguous()

        cases = [(prefix + "fwd", fwd), (prefix + "fwdbwd", fwdbwd)]
        if cl:
            cases.append((prefix + "fwdbwd_contig_grads", fwdbwd_contig_grads))
        for name, fn in cases:
            try:
                emit(name, median_ms(torch, fn, args.reps, args.warmup))
            except Exception as e:  # noqa: BLE001 - report and go on, as the C++ side does
                emit(name, error=str(e))


if __name__ == "__main__":
    main()
