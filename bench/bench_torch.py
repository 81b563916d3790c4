#!/usr/bin/env python3
"""PyTorch twin of bench/bench_ops.cpp: the same ops, sizes, dtypes and timing method, printing the
same result lines ("BENCH {json}") so that bench/compare.py can join the two.

Method: random inputs; warm-up calls; then `reps` calls queued back to back on the current stream
with a torch.cuda.Event between consecutive calls; the median per-call time. GB/s counts bytes read
plus bytes written; pct_d2d is that rate over a device-to-device copy of 256 MiB measured the same
way (dst.copy_(src), a cudaMemcpyAsync). GEMM: TFLOP/s of a bf16 8192^3 matmul. Host overhead: host
microseconds per add of two 1024-element tensors over many calls without a sync between them.

--compile: only the cases where torch.compile can change the kernels (elementwise chains, norm +
modulate, softmax, gelu), each op wrapped in torch.compile (default mode; compilation happens in the
warm-up), same names; the lines carry "impl": "compile".

Usage: python3 bench/bench_torch.py [--reps N] [--warmup N] [--small-calls N] [--only a,b] [--compile]
"""
import argparse
import json
import statistics
import sys
import time

from bench_timing import median_ms

MIB = 1 << 20
BYTES = 256 * MIB            # each big tensor
ELEMS = BYTES // 4           # f32 elements
SQUARE = 8192                # [8192, 8192] f32 = 256 MiB
SOFTMAX_COLS = 4096          # [16384, 4096] f32 = 256 MiB
SOFTMAX_ROWS = ELEMS // SOFTMAX_COLS
GEMM = 8192
SMALL = 1024
SMALL_BURST = 200            # small-op calls per timed burst (the launch queue never fills)
SMALL_BURSTS = 50
MOD_ROWS, MOD_TOKENS, MOD_HIDDEN = 1024, 196, 384   # norm_modulate_bf16: 147 MiB bf16
DIT_TOKENS, DIT_HIDDEN, DIT_MLP = 50176, 384, 1536  # DiT-S B256 MLP GEMMs (as nn.Linear: x @ W^T)
# Cases that --compile times through torch.compile (where compiling can change the kernels).
COMPILE_CASES = ["gelu", "softmax_bf16", "ew_chain", "norm_modulate_bf16", "dequantize_fp8"]


IMPL = "eager"


def emit(name, value=None, unit=None, ms=None, pct_d2d=None, error=None):
    rec = {"name": name, "impl": IMPL}
    if error is not None:
        rec["error"] = error
    else:
        rec.update({"value": float(f"{value:.4g}"), "unit": unit, "ms": round(ms, 4)})
        if pct_d2d is not None:
            rec["pct_d2d"] = round(pct_d2d, 1)
    print("BENCH " + json.dumps(rec), flush=True)


CHAIN_OPS = 1000             # bench_ops.cpp Note [Chain benchmark]
CHAIN_ROUNDS = 15


def bench_chain(torch, dev):
    x = torch.rand(SMALL, device=dev)
    c = torch.empty(SMALL, device=dev).uniform_(0.9, 1.1)
    d = torch.empty(SMALL, device=dev).uniform_(-0.1, 0.1)

    def forward():
        y = x
        for _ in range(CHAIN_OPS // 2):
            y = y * c + d
        return y

    nograd, record, fwd_sync, fwd_bwd_sync = [], [], [], []
    for r in range(CHAIN_ROUNDS + 2):
        keep = r >= 2
        with torch.no_grad():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            y = forward()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            if keep:
                nograd.append((t1 - t0) * 1e6)
        c.requires_grad_(True)
        d.requires_grad_(True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y = forward()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if keep:
            record.append((t1 - t0) * 1e6)
            fwd_sync.append((t2 - t0) * 1e6)
        del y
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gc, gd = torch.autograd.grad(forward().sum(), [c, d])
        torch.cuda.synchronize()
        if keep:
            fwd_bwd_sync.append((time.perf_counter() - t0) * 1e6)
        c.requires_grad_(False)
        d.requires_grad_(False)
    n = float(CHAIN_OPS)
    nog, rec = statistics.median(nograd) / n, statistics.median(record) / n
    bwd = (statistics.median(fwd_bwd_sync) - statistics.median(fwd_sync)) / n
    emit("chain_fwd_nograd", nog, "us/call", nog * 1e-3)
    emit("chain_fwd_record", rec, "us/call", rec * 1e-3)
    emit("chain_bwd", bwd, "us/call", bwd * 1e-3)


def bench_mlp_step(torch, dev):
    width, batch, layers, steps, warm = 1024, 64, 4, 50, 5
    ws = [torch.empty(width, width, device=dev).uniform_(-0.03, 0.03).requires_grad_() for _ in range(layers)]
    bs = [torch.empty(width, device=dev).uniform_(-0.03, 0.03).requires_grad_() for _ in range(layers)]
    x = torch.randn(batch, width, device=dev)
    target = torch.randn(batch, width, device=dev)
    params = ws + bs
    times = []
    for s in range(steps + warm):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        h = x
        for i in range(layers):
            h = h @ ws[i].t() + bs[i]
            if i + 1 < layers:
                h = torch.relu(h)
        grads = torch.autograd.grad(torch.nn.functional.mse_loss(h, target), params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.add_(g, alpha=-1e-3)
        torch.cuda.synchronize()
        if s >= warm:
            times.append((time.perf_counter() - t0) * 1e6)
    us = statistics.median(times)
    emit("mlp_step", us, "us/call", us * 1e-3)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--small-calls", type=int, default=10000)
    ap.add_argument("--only", default="")
    ap.add_argument("--compile", action="store_true", help="time the compile-able cases via torch.compile")
    args = ap.parse_args()
    only = [s for s in args.only.split(",") if s]
    global IMPL
    if args.compile:
        IMPL = "compile"
        only = [s for s in (only or COMPILE_CASES) if s in COMPILE_CASES] or ["(none)"]

    def wants(name):
        return not only or name in only

    import torch
    if not torch.cuda.is_available():
        print("# bench_torch: no CUDA device; nothing to measure")
        return 0
    dev = torch.device("cuda", 0)
    compiled = torch.compile if args.compile else (lambda f: f)
    props = torch.cuda.get_device_properties(0)
    print(f"# bench_torch: PyTorch {torch.__version__} on {props.name} ({props.multi_processor_count} SMs), "
          f"reps {args.reps}, warm-up {args.warmup}", flush=True)
    reps, warmup = args.reps, args.warmup

    src = torch.rand(ELEMS, device=dev)
    dst = torch.empty_like(src)
    ms = median_ms(torch, lambda: dst.copy_(src), reps, warmup)
    d2d = 2.0 * BYTES / (ms * 1e-3) / 1e9
    if not args.compile:  # the same copy either way
        emit("d2d_copy", d2d, "GB/s", ms, 100.0)
    del src, dst

    S = float(BYTES)

    def setup_add():
        x, y = torch.rand(ELEMS, device=dev), torch.rand(ELEMS, device=dev)
        return lambda: x + y

    def setup_mul():
        x, y = torch.rand(ELEMS, device=dev), torch.rand(ELEMS, device=dev)
        return lambda: x * y

    def setup_gelu():
        x = torch.randn(ELEMS, device=dev)
        f = compiled(lambda t: torch.nn.functional.gelu(t))
        return lambda: f(x)

    def setup_copy():
        x = torch.rand(ELEMS, device=dev)
        return lambda: x.clone()

    def setup_transpose():
        x = torch.rand(SQUARE, SQUARE, device=dev)
        return lambda: x.t().contiguous()

    def setup_transpose_bf16():
        x = torch.rand(2 * SQUARE, SQUARE, device=dev).to(torch.bfloat16)
        return lambda: x.t().contiguous()

    def setup_transpose_fp8():
        x = torch.rand(4 * SQUARE, SQUARE, device=dev).to(torch.float8_e4m3fn)
        return lambda: x.t().contiguous()

    def setup_dequantize_fp8():
        q = torch.rand(4 * SQUARE, SQUARE, device=dev).to(torch.float8_e4m3fn)
        s = torch.rand(4 * SQUARE, 1, device=dev)
        f = compiled(lambda t, sc: (t.float() * sc).to(torch.bfloat16))
        return lambda: f(q, s)

    def setup_softmax_bf16():
        x = torch.randn(SOFTMAX_ROWS, 2 * SOFTMAX_COLS, device=dev).to(torch.bfloat16)
        f = compiled(lambda t: torch.softmax(t, dim=-1))
        return lambda: f(x)

    def setup_ew_chain():
        x = torch.randn(ELEMS, device=dev)
        f = compiled(lambda t: torch.relu(t * 0.5 + 1.0) * t)
        return lambda: f(x)

    def setup_norm_modulate():
        x = torch.randn(MOD_ROWS, MOD_TOKENS, MOD_HIDDEN, device=dev).to(torch.bfloat16)
        scale = (torch.randn(MOD_ROWS, 1, MOD_HIDDEN, device=dev) * 0.1).to(torch.bfloat16)
        shift = (torch.randn(MOD_ROWS, 1, MOD_HIDDEN, device=dev) * 0.1).to(torch.bfloat16)
        f = compiled(lambda t, sc, sh: torch.nn.functional.layer_norm(t, (MOD_HIDDEN,), eps=1e-6) * (sc + 1.0) + sh)
        return lambda: f(x, scale, shift)

    def setup_sum():
        x = torch.rand(ELEMS, device=dev)
        return lambda: x.sum()

    def setup_sum_columns():
        x = torch.rand(SOFTMAX_ROWS, SOFTMAX_COLS, device=dev)
        return lambda: x.sum(0)

    def setup_softmax():
        x = torch.randn(SOFTMAX_ROWS, SOFTMAX_COLS, device=dev)
        return lambda: torch.softmax(x, dim=-1)

    mem_ops = [("add", 3 * S, setup_add), ("mul", 3 * S, setup_mul), ("gelu", 2 * S, setup_gelu),
               ("copy", 2 * S, setup_copy), ("transpose_contiguous", 2 * S, setup_transpose),
               ("transpose_bf16", 2 * S, setup_transpose_bf16), ("transpose_fp8", 2 * S, setup_transpose_fp8),
               ("dequantize_fp8", 3 * S, setup_dequantize_fp8), ("sum", S, setup_sum),
               ("sum_columns", S, setup_sum_columns),
               ("softmax", 2 * S, setup_softmax), ("softmax_bf16", 2 * S, setup_softmax_bf16),
               ("ew_chain", 2 * S, setup_ew_chain),
               ("norm_modulate_bf16", 2.0 * MOD_ROWS * MOD_TOKENS * MOD_HIDDEN * 2, setup_norm_modulate)]
    for name, nbytes, setup in mem_ops:
        if not wants(name):
            continue
        try:
            fn = setup()
            ms = median_ms(torch, fn, reps, warmup)
            gbps = nbytes / (ms * 1e-3) / 1e9
            emit(name, gbps, "GB/s", ms, 100.0 * gbps / d2d)
            del fn
        except Exception as e:  # report and go on, like bench_ops
            emit(name, error=str(e))
        torch.cuda.empty_cache()

    if wants("gemm_bf16"):
        try:
            a = torch.randn(GEMM, GEMM, device=dev).to(torch.bfloat16)
            b = torch.randn(GEMM, GEMM, device=dev).to(torch.bfloat16)
            ms = median_ms(torch, lambda: a @ b, reps, warmup)
            emit("gemm_bf16", 2.0 * GEMM ** 3 / (ms * 1e-3) / 1e12, "TFLOP/s", ms)
            del a, b
        except Exception as e:
            emit("gemm_bf16", error=str(e))

    for name, m, n, k in (("gemm_dit_fc1_bf16", DIT_TOKENS, DIT_MLP, DIT_HIDDEN),
                          ("gemm_dit_fc2_bf16", DIT_TOKENS, DIT_HIDDEN, DIT_MLP)):
        if not wants(name):
            continue
        try:
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            w = (torch.randn(n, k, device=dev) * 0.05).to(torch.bfloat16)
            ms = median_ms(torch, lambda: x @ w.t(), reps, warmup)
            emit(name, 2.0 * m * n * k / (ms * 1e-3) / 1e12, "TFLOP/s", ms)
            del x, w
        except Exception as e:
            emit(name, error=str(e))

    if wants("add_small_host"):
        a, b = torch.rand(SMALL, device=dev), torch.rand(SMALL, device=dev)
        for _ in range(200):
            a + b
        torch.cuda.synchronize()
        bursts = []
        for _ in range(SMALL_BURSTS):
            t0 = time.perf_counter()
            for _ in range(SMALL_BURST):
                a + b
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            bursts.append((t1 - t0) * 1e6 / SMALL_BURST)
        us = statistics.median(bursts)
        emit("add_small_host", us, "us/call", us * 1e-3)
        t0 = time.perf_counter()
        for _ in range(args.small_calls):
            a + b
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        us = (t2 - t0) * 1e6 / args.small_calls
        emit("add_small_gpu", us, "us/call", us * 1e-3)
    if wants("chain"):
        bench_chain(torch, dev)
    if wants("mlp_step"):
        bench_mlp_step(torch, dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
