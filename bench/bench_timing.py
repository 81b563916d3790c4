"""Timing shared by the PyTorch twins of the benchmarks (the method of bench/bench_timing.h):
warm-up calls, then `reps` calls queued back to back on the current stream with a CUDA event
between consecutive calls; the median per-call time in milliseconds. FLAME_BENCH_DUMP=1 also
prints every call's time in order to stderr."""
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
