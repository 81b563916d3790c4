"""What the parity scripts share (models_unet.py, models_flux.py, models_sd3.py): the timing of a
training step on the GPU, the same method as the FLAME tools' (unet_parity, flux_parity,
sd3_parity time): untimed warm-up steps, then the median of CUDA-event-timed steps and the peak
allocated memory over them; and a PEFT LoRA with seeded B on a diffusers transformer."""
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


def add_lora(model, targets, rank, alpha, seed, b_std, dtype):
    """A PEFT LoRA on `targets`: the adapters in `dtype` and trainable, everything else frozen, B drawn
    from N(0, b_std) with `seed` (0: PEFT's zero init). Returns {PEFT's saved name: parameter}."""
    from peft import LoraConfig
    model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights=True, target_modules=targets))
    gen = torch.Generator().manual_seed(seed + 2)
    adapters = {}
    for n, p in model.named_parameters():
        is_lora = ".lora_A." in n or ".lora_B." in n
        p.requires_grad_(is_lora)
        if is_lora:
            with torch.no_grad():
                p.data = p.data.to(dtype)
                if ".lora_B." in n:
                    p.copy_(torch.randn(p.shape, generator=gen).to(p.device, dtype) * b_std)
            adapters[n.replace(".default", "")] = p  # PEFT's saved name: no adapter name
    return adapters
