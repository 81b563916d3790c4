#!/usr/bin/env python3
"""PyTorch twin of bench/bench_epi.cpp: F.linear with bias, gelu(F.linear(...), approximate='tanh')
and the DiT-S MLP in bf16, forward (no grad) and forward+backward, same names, shapes and timing
(CUDA events between back-to-back calls, warm-up, median). TFLOP/s counts the GEMMs only (2MNK
forward, 6MNK forward+backward per layer), and the piece_* lines time single pieces of the DiT-S
MLP/attention step (fc1 forward with the pre-activation saved, the MLP's data gradient through
gelu', the weight+bias gradients of fc1 and qkv). Gradients come from torch.autograd.grad (no accumulation
into .grad), as FLAME's backward returns a fresh store. The FLAME-only lines (*_unfused,
*_mlp_gelu) have no twin here.

Usage: python3 bench/bench_epi_torch.py [--reps N] [--warmup N]
"""
import math

from bench_timing import emit_rate, median_ms, twin_start


def emit(name, flops, ms):
    emit_rate(name, flops / (ms * 1e-3) / 1e12, "TFLOP/s", ms)


def main():
    start = twin_start("bench_epi_torch", __doc__.splitlines()[0], ", bf16")
    if start is None:
        return 0
    args, torch, dev = start
    import torch.nn.functional as F
    reps, warmup = args.reps, args.warmup
    bf16 = dict(device=dev, dtype=torch.bfloat16)

    def layer(name, M, K, N, op):
        x0 = torch.randn(M, K, **bf16)
        w = (torch.randn(N, K, **bf16) * (1.0 / math.sqrt(K))).requires_grad_()
        b = (torch.randn(N, **bf16) * 0.1).requires_grad_()
        dy = torch.randn(M, N, **bf16)
        flops = 2.0 * M * N * K
        with torch.no_grad():
            emit(name + "_fwd", flops, median_ms(torch, lambda: op(x0, w, b), reps, warmup))
        x = x0.detach().requires_grad_()
        emit(name + "_fwdbwd", 3 * flops,
             median_ms(torch, lambda: torch.autograd.grad(op(x, w, b), [x, w, b], dy), reps, warmup))
        del x0, x, w, b, dy

    for tag, M, K, N in (("dit_fc1", 50176, 384, 1536), ("dit_fc2", 50176, 1536, 384), ("sq4096", 8192, 4096, 4096)):
        layer("linear_bias_" + tag, M, K, N, lambda x, w, b: F.linear(x, w, b))
        layer("linear_gelu_" + tag, M, K, N, lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh"))

    M, D, H = 50176, 384, 1536
    x0 = torch.randn(M, D, **bf16)
    w1 = (torch.randn(H, D, **bf16) * (1.0 / math.sqrt(D))).requires_grad_()
    b1 = (torch.randn(H, **bf16) * 0.1).requires_grad_()
    w2 = (torch.randn(D, H, **bf16) * (1.0 / math.sqrt(H))).requires_grad_()
    b2 = (torch.randn(D, **bf16) * 0.1).requires_grad_()
    dy = torch.randn(M, D, **bf16)

    def mlp(x):
        return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)

    flops = 2.0 * 2.0 * M * D * H
    with torch.no_grad():
        emit("dit_mlp_fwd", flops, median_ms(torch, lambda: mlp(x0), reps, warmup))
    x = x0.detach().requires_grad_()
    emit("dit_mlp_fwdbwd", 3 * flops,
         median_ms(torch, lambda: torch.autograd.grad(mlp(x), [x, w1, b1, w2, b2], dy), reps, warmup))
    del x0, x, w1, b1, w2, b2, dy

    # Pieces (bench_epi.cpp's piece_* lines; its _heuristic/_bgradb/_colsum variants are FLAME-only).
    # fc1 forward with autograd recording (weights require grad; gelu saves its input).
    x = torch.randn(M, D, **bf16)
    w = (torch.randn(H, D, **bf16) * (1.0 / math.sqrt(D))).requires_grad_()
    b = (torch.randn(H, **bf16) * 0.1).requires_grad_()
    emit("piece_fc1_gelu_aux_fwd", 2.0 * M * D * H,
         median_ms(torch, lambda: F.gelu(F.linear(x, w, b), approximate="tanh"), reps, warmup))
    del x, w, b
    # The MLP's data gradient: dh = (dy W2) * gelu'(pre), dx = dh W1; only x requires grad,
    # backward alone on a retained graph.
    x = torch.randn(M, D, **bf16).requires_grad_()
    w1 = torch.randn(H, D, **bf16) * (1.0 / math.sqrt(D))
    b1 = torch.randn(H, **bf16) * 0.1
    w2 = torch.randn(D, H, **bf16) * (1.0 / math.sqrt(H))
    b2 = torch.randn(D, **bf16) * 0.1
    dy = torch.randn(M, D, **bf16)
    y = F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)
    emit("piece_mlp_dgelu_dx_bwd", 2.0 * 2.0 * M * D * H,
         median_ms(torch, lambda: torch.autograd.grad(y, [x], dy, retain_graph=True), reps, warmup))
    del x, w1, b1, w2, b2, dy, y
    # Weight and bias gradients of fc1 (dy [M, 1536]) and qkv (dy [M, 1152]), input [M, 384]:
    # only the weight and bias require grad, backward alone on a retained graph.
    for tag, N in (("fc1", H), ("qkv", 1152)):
        x = torch.randn(M, D, **bf16)
        w = (torch.randn(N, D, **bf16) * (1.0 / math.sqrt(D))).requires_grad_()
        b = (torch.randn(N, **bf16) * 0.1).requires_grad_()
        dy = torch.randn(M, N, **bf16)
        y = F.linear(x, w, b)
        emit(f"piece_{tag}_wgrad_bgrad", 2.0 * M * D * N,
             median_ms(torch, lambda: torch.autograd.grad(y, [w, b], dy, retain_graph=True), reps, warmup))
        del x, w, b, dy, y
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
