"""Timing shared by the PyTorch twins of the benchmarks (the method of bench/bench_timing.h):
warm-up calls, then `reps` calls queued back to back on the current stream with a CUDA event
between consecutive calls; the median per-call time in milliseconds. FLAME_BENCH_DUMP=1 also
prints every call's time in order to stderr."""
import argparse
import json
import os
import statistics
import sys


def median_ms(torch, fn, reps, warmup):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    events[0].record()
    for r in range(reps):
        fn()
        events[r + 1].record()
    torch.cuda.synchronize()
    times = [events[r].elapsed_time(events[r + 1]) for r in range(reps)]
    if os.environ.get("FLAME_BENCH_DUMP"):  # every call's time, in order (drift, outliers)
        print("# per-call ms: " + " ".join(f"{t:.4f}" for t in times), file=sys.stderr, flush=True)
    return statistics.median(times)


def emit_rate(name, value, unit, ms):
    """One BENCH line with a rate (GB/s, TFLOP/s) and the time it came from."""
    print("BENCH " + json.dumps({"name": name, "value": float(f"{value:.4g}"), "unit": unit, "ms": round(ms, 4)}),
          flush=True)


def twin_start(prog, description, detail=""):
    """The start every op twin shares: --reps/--warmup, torch imported, the GPU named on a comment
    line. Returns (args, torch, device), or None (after saying so) when there is no CUDA device."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        print(f"# {prog}: no CUDA device; nothing to measure")
        return None
    print(f"# {prog}: PyTorch {torch.__version__} on {torch.cuda.get_device_name(0)}, "
          f"reps {args.reps}, warm-up {args.warmup}{detail}", flush=True)
    return args, torch, torch.device("cuda", 0)
