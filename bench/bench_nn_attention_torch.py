"""PyTorch twin of bench_nn_attention.cpp: the same names, shapes and timing (CUDA events between
consecutive calls, warm-up first, median ms). torch.nn.functional.scaled_dot_product_attention with
its default backend choice.
  sdpa_bf16_s4096_d128_{fwd,fwdbwd}[_causal]: B8 H16 S4096 D128
  sdpa_bf16_s256_d64_{fwd,fwdbwd}:           B32 H16 S256 D64
"""
import argparse
import json

from bench_timing import median_ms


def emit(name, ms):
    print("BENCH " + json.dumps({"name": name, "value": float(f"{ms:.4g}"), "unit": "ms", "ms": round(ms, 4)}),
          flush=True)


def bench_shape(torch, base, b, h, s, d, causal, reps, warmup):
    import torch.nn.functional as F
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(1234)
    q, k, v, gout = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4))
    suffix = "_causal" if causal else ""
    with torch.no_grad():
        emit(base + "_fwd" + suffix,
             median_ms(torch, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), reps, warmup))
    for t in (q, k, v):
        t.requires_grad_(True)

    def fwdbwd():
        # autograd.grad returns fresh gradients like FLAME's backward (no accumulation into .grad).
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.autograd.grad(out, (q, k, v), gout)

    emit(base + "_fwdbwd" + suffix, median_ms(torch, fwdbwd, reps, warmup))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("# bench_nn_attention_torch: no CUDA device")
        return
    bench_shape(torch, "sdpa_bf16_s4096_d128", 8, 16, 4096, 128, False, args.reps, args.warmup)
    bench_shape(torch, "sdpa_bf16_s4096_d128", 8, 16, 4096, 128, True, args.reps, args.warmup)
    bench_shape(torch, "sdpa_bf16_s256_d64", 32, 16, 256, 64, False, args.reps, args.warmup)
    bench_shape(torch, "sdpa_bf16_dit_s196_d64", 256, 6, 196, 64, False, args.reps, args.warmup)


if __name__ == "__main__":
    main()
