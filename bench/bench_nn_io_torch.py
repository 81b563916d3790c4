#!/usr/bin/env python3
"""PyTorch twin of bench_nn_io: safetensors load to / save from the GPU with safetensors.torch.

Same file (32 bf16 tensors [4096, 2048], 512 MiB, warm page cache), same method: wall clock up to
torch.cuda.synchronize(), one warm-up, median of 5. Prints BENCH lines with the same names.
"""
import json
import os
import statistics
import tempfile
import time

TENSORS, ROWS, COLS, REPS = 32, 4096, 2048, 5


def emit(name, nbytes, ms):
    print("BENCH " + json.dumps({"name": name, "value": float(f"{nbytes / (ms * 1e-3) / 1e9:.4g}"),
                                 "unit": "GB/s", "ms": round(ms, 4)}), flush=True)


def median_ms(torch, fn):
    fn()
    times = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main():
    import torch
    from safetensors.torch import load_file, save_file
    if not torch.cuda.is_available():
        print("# bench_nn_io_torch: no CUDA device")
        return
    path = os.path.join(tempfile.gettempdir(), f"torch_bench_io_{os.getpid()}.safetensors")
    sd = {f"w{i}": torch.randn(ROWS, COLS, device="cuda").to(torch.bfloat16) for i in range(TENSORS)}
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    torch.cuda.synchronize()
    try:
        emit("safetensors_save_from_cuda_512MiB", nbytes, median_ms(torch, lambda: save_file(sd, path)))
        emit("safetensors_load_to_cuda_512MiB", nbytes, median_ms(torch, lambda: load_file(path, device="cuda")))
    finally:
        if os.path.exists(path):
            os.remove(path)


if __name__ == "__main__":
    main()
