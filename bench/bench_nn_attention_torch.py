"""PyTorch twin of bench_nn_attention.cpp: the same names, shapes and timing (CUDA events between
consecutive calls, warm-up first, median ms). torch.nn.functional.scaled_dot_product_attention with
its default backend choice.
  sdpa_bf16_s4096_d128_{fwd,fwdbwd}[_causal]: B8 H16 S4096 D128
  sdpa_bf16_s256_d64_{fwd,fwdbwd}:           B32 H16 S256 D64
  sdpa_qkv_packed_bf16_fwdbwd: B256 L196 H6 D64 (dit-s) from qkv [B, L, 3HD]: reshape/permute/
    unbind + SDPA + transpose/reshape (timm's attention); sdpa_qkv_select_bf16_fwdbwd: the same
    with q, k, v taken by indexing (one select each, as FLAME's select composite)
  *_short: the twins of FLAME's rows on its short-sequence kernels (the same PyTorch calls again)
"""
import argparse
import json
import os

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

    if not os.environ.get("FLAME_BENCH_TRACE"):
        emit(base + "_fwdbwd" + suffix, median_ms(torch, fwdbwd, reps, warmup))
        return
    # The kernels of the timed calls themselves (warm-up included), as the FLAME side traces them.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        emit(base + "_fwdbwd" + suffix, median_ms(torch, fwdbwd, reps, warmup))
    print(f"# kernels of the {reps} timed {base}{suffix} forward+backward calls (and {warmup} warm-up; "
          f"cuDNN {torch.backends.cudnn.version()}):")
    try:
        table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=100)
    except (AttributeError, KeyError):
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=100)
    print(table)


def bench_packed(torch, b, l, h, d, reps, warmup, suffix=""):
    import torch.nn.functional as F
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(1234)
    qkv = torch.randn(b, l, 3 * h * d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
    gout = torch.randn(b, l, h * d, device=dev, dtype=torch.bfloat16, generator=g)

    def attend(unbind):
        p = qkv.reshape(b, l, 3, h, d).permute(2, 0, 3, 1, 4)
        q, k, v = p.unbind(0) if unbind else (p[0], p[1], p[2])
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, l, h * d)

    for name, unbind in (("sdpa_qkv_packed" + suffix + "_bf16_fwdbwd", True),
                         ("sdpa_qkv_select" + suffix + "_bf16_fwdbwd", False)):
        emit(name, median_ms(torch, lambda: torch.autograd.grad(attend(unbind), (qkv,), gout), reps, warmup))


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
    bench_packed(torch, 256, 196, 6, 64, args.reps, args.warmup)
    # Twins of FLAME's *_short rows (its short-sequence kernels): PyTorch measured again.
    bench_shape(torch, "sdpa_bf16_s256_d64_short", 32, 16, 256, 64, False, args.reps, args.warmup)
    bench_shape(torch, "sdpa_bf16_dit_s196_d64_short", 256, 6, 196, 64, False, args.reps, args.warmup)
    bench_packed(torch, 256, 196, 6, 64, args.reps, args.warmup, "_short")


if __name__ == "__main__":
    main()
