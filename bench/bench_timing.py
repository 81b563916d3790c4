"""Timing shared by the PyTorch twins of the benchmarks (the method of bench/bench_timing.h):
warm-up calls, then `reps` calls queued back to back on the current stream with a CUDA event
between consecutive calls; the median per-call time in milliseconds."""
import statistics


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
    return statistics.median(events[r].elapsed_time(events[r + 1]) for r in range(reps))
