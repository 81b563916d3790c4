#!/usr/bin/env python3
"""PyTorch twin of tools/numerics_parity.cpp (the ops added for issue #26).

  python3 tools/parity_numerics.py --flame-bin build/tools/flame-numerics-parity [--device cuda]

Runs the FLAME program (which writes its inputs, outputs and gradients to a safetensors file),
recomputes every case with PyTorch on the same inputs and device (TF32 off for matmuls; for the
conv case also for cuDNN, as the FLAME side), and prints one line per output or gradient:
`<case> <tensor> max_abs_diff <d> tol <t> PASS|FAIL`. Exits non-zero when any line fails.
"""
import argparse
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def sdpa_math(q, k, v, mask):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def interp(size=None, scale=None, mode="nearest", align=None, aa=False):
    def f(x):
        return F.interpolate(x, size=size, scale_factor=scale, mode=mode, align_corners=align, antialias=aa)
    return f


def cases(fixed):
    """name -> (function of the differentiable inputs in FLAME's order, tolerance for f32)."""
    c = {
        "hardswish": (lambda x: F.hardswish(x), 1e-6),
        "hardsigmoid": (lambda x: F.hardsigmoid(x), 1e-6),
        "smooth_l1_beta0": (lambda a, b: F.smooth_l1_loss(a, b, beta=0.0), 1e-6),
        "smooth_l1_beta5": (lambda a, b: F.smooth_l1_loss(a, b, beta=0.5), 1e-6),
        "smooth_l1_beta10": (lambda a, b: F.smooth_l1_loss(a, b, beta=1.0), 1e-6),
        "huber_delta5": (lambda a, b: F.huber_loss(a, b, reduction="none", delta=0.5), 1e-6),
        "huber_delta20": (lambda a, b: F.huber_loss(a, b, reduction="none", delta=2.0), 1e-6),
        "bce": (lambda x: F.binary_cross_entropy_with_logits(
            x, fixed("bce.fixed.target"), weight=fixed("bce.fixed.weight"),
            pos_weight=fixed("bce.fixed.pos_weight")), 1e-6),
        "ce_weighted": (lambda x: F.cross_entropy(x, fixed("ce.fixed.target"), weight=fixed("ce.fixed.weight"),
                                                  label_smoothing=0.1), 1e-6),
        "ce3_weighted": (lambda x: F.cross_entropy(x, fixed("ce3.fixed.target"), weight=fixed("ce.fixed.weight")), 1e-6),
        "ce_soft": (lambda x: F.cross_entropy(x, fixed("ce_soft.fixed.target"), weight=fixed("ce.fixed.weight"),
                                              label_smoothing=0.2), 1e-6),
        "interp_bicubic_up": (interp((31, 40), mode="bicubic"), 1e-5),
        "interp_bicubic_up_align": (interp((31, 40), mode="bicubic", align=True), 1e-5),
        "interp_bicubic_down": (interp((7, 9), mode="bicubic"), 1e-5),
        "interp_bilinear_aa_down": (interp((7, 9), mode="bilinear", aa=True), 1e-5),
        "interp_bicubic_aa_down": (interp((6, 10), mode="bicubic", aa=True), 1e-5),
        "interp_bicubic_aa_align": (interp((5, 8), mode="bicubic", align=True, aa=True), 1e-5),
        "interp_bicubic_aa_up": (interp((25, 30), mode="bicubic", aa=True), 1e-5),
        "interp_bicubic_scale": (interp(scale=(1.7, 0.45), mode="bicubic"), 1e-5),
        "interp_linear_1d": (interp(45, mode="linear"), 1e-6),
        "sdpa_masked_f32": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=fixed("sdpa.fixed.mask")),
                            2e-5),
        # PyTorch's semantics for a fully hidden row (0, no gradient: _safe_softmax since 2.5) are those
        # of its math and memory-efficient backends. Its cuDNN backend, the default for this bf16 call
        # on an H200 with PyTorch 2.11, returns the mean of v there instead (and passes gradient to v),
        # so the reference is pinned to the math backend.
        "sdpa_masked_bf16": (lambda q, k, v: sdpa_math(q, k, v, fixed("sdpa.fixed.mask")), 5e-2),
        "conv2d_f32_no_tf32": (lambda x, w: F.conv2d(x, w, padding=1), 2e-4),
    }
    return c


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flame-bin", required=True, help="path of the flame-numerics-parity program")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False  # the FLAME side's conv case runs with TF32 off
    dev = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "flame_numerics.safetensors")
        subprocess.run([args.flame_bin, path, args.device], check=True)
        data = load_file(path)

    def fixed(name):
        return data[name].to(dev)

    table = cases(fixed)
    names = sorted({k.split(".")[0] for k in data if ".out" in k})
    failed = 0
    for name in names:
        if name not in table:
            print(f"{name}: no PyTorch twin in this script FAIL")
            failed += 1
            continue
        fn, tol = table[name]
        in_names = sorted(k[len(name) + 4:] for k in data if k.startswith(name + ".in.") and not k.endswith(".gout"))
        inputs = [data[f"{name}.in.{n}"].to(dev).requires_grad_(True) for n in in_names]
        out = fn(*inputs)
        out.backward(data[f"{name}.in.gout"].to(dev).to(out.dtype))
        pairs = [("out", out.detach(), data[f"{name}.out"])]
        pairs += [(f"grad.{n}", t.grad, data[f"{name}.grad.{n}"]) for n, t in zip(in_names, inputs)]
        for what, want, got in pairs:
            want64, got64 = want.double().cpu(), got.double()
            scale = max(1.0, want64.abs().max().item()) if want64.numel() else 1.0
            diff = (want64 - got64).abs().max().item() if want64.numel() else 0.0
            ok = want64.shape == got64.shape and diff <= tol * scale
            failed += not ok
            print(f"{name} {what} max_abs_diff {diff:.3e} tol {tol * scale:.1e} {'PASS' if ok else 'FAIL'}")
    print(f"numerics parity ({args.device}, torch {torch.__version__}): {'PASS' if failed == 0 else f'{failed} FAIL'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
