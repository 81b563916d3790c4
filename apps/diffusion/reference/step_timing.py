"""Timing of a training step on the GPU, shared by the reference scripts (models_unet.py,
models_flux.py, models_sd3.py): the same method as the FLAME tools' (unet_parity, flux_parity,
sd3_parity time): untimed warm-up steps, then the median of CUDA-event-timed steps and the peak
allocated memory over them."""
import statistics
import time

import torch


def time_steps(step, warmup, steps):
    """{"median_ms", "peak_gib", "warmup_s"} of `step` (warmup_s includes any compilation)."""
    t0 = time.time()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    warmup_s = time.time() - t0
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return {"median_ms": round(statistics.median(times), 2),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
            "warmup_s": round(warmup_s, 1)}
