#!/usr/bin/env python3
"""PyTorch twin of bench/bench_train_optim.cpp: one optimizer step (or EMA update) over 100M
parameters in 200 tensors of mixed sizes, same names, sizes, dtypes and timing (CUDA events
between back-to-back steps, warm-up, median).

- optim_adamw_f32_100m: torch.optim.AdamW(fused=True).
- optim_sgd_momentum_f32_100m: torch.optim.SGD(momentum=0.9, fused=True) (foreach where this
  PyTorch has no fused SGD).
- optim_adamw_bf16_master_100m: PyTorch has no master-weight optimizer; the equivalent is a fused
  AdamW step on f32 master copies (their .grad the bf16 gradients, converted once outside the
  timed step) followed by torch._foreach_copy_ of the masters into the bf16 parameters.
- optim_ema_f32_100m: torch._foreach_lerp_(shadow, params, 1 - decay).

GB/s counts the bytes a step must move (see the C++ file); pct_d2d is that rate over a 256 MiB
device-to-device copy timed the same way (optim_d2d_copy).

Usage: python3 bench/bench_train_optim_torch.py [--reps N] [--warmup N]
"""
import argparse
import json

from bench_timing import median_ms

TOTAL = 100_000_000
TENSORS = 200


def optim_sizes():
    """Every 4th tensor is small (1024 + 7 i elements); the other 150 share the rest in
    proportion 1:2:3:4:5 (i mod 5), the last taking the remainder (as the C++ file)."""
    n = [0] * TENSORS
    small = sum(1024 + 7 * i for i in range(TENSORS) if i % 4 == 3)
    weight_sum = sum(1 + i % 5 for i in range(TENSORS) if i % 4 != 3)
    rest = TOTAL - small
    used, last = 0, -1
    for i in range(TENSORS):
        if i % 4 == 3:
            n[i] = 1024 + 7 * i
            continue
        n[i] = rest * (1 + i % 5) // weight_sum
        used += n[i]
        last = i
    n[last] += rest - used
    return n


def emit(name, bytes_per_step, ms, d2d):
    gbps = bytes_per_step / (ms * 1e-3) / 1e9
    print("BENCH " + json.dumps({"name": name, "value": float(f"{gbps:.4g}"), "unit": "GB/s",
                                 "ms": round(ms, 4), "pct_d2d": round(100.0 * gbps / d2d, 1)}), flush=True)


def check_against_torch(torch, dev):
    """Note [PyTorch check] in bench_train_optim.cpp: the same 20 float64 steps with torch.optim."""
    import math
    shapes = [(7,), (5, 3), (2, 3, 5), (3, 4)]

    def values(shape, phase, freq):
        n = math.prod(shape)
        return torch.tensor([math.sin(freq * k + phase) for k in range(n)], dtype=torch.float64,
                            device=dev).reshape(shape)

    def run(name, make):
        ps = [values(s, float(i), 0.37).requires_grad_(True) for i, s in enumerate(shapes)]
        opt = make(ps)
        for t in range(20):
            for i, p in enumerate(ps):
                p.grad = None if (i == 3 and t % 3 == 1) else values(shapes[i], 1.0 + i, 0.11 * (t + 1)) * 0.5
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in ps])
        print(f"# check {name} sum={flat.sum().item():.12e} absmax={flat.abs().max().item():.12e}", flush=True)

    run("adamw", lambda ps: torch.optim.AdamW(
        [{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-2, "weight_decay": 0.01}], lr=1e-2, weight_decay=0.1))
    run("adam_amsgrad", lambda ps: torch.optim.Adam(
        [{"params": ps[:2]}, {"params": ps[2:], "betas": (0.8, 0.99)}], lr=1e-2, weight_decay=0.01, amsgrad=True))
    run("sgd_nesterov", lambda ps: torch.optim.SGD(
        [{"params": ps[:2]}, {"params": ps[2:], "momentum": 0.5}], lr=1e-2, momentum=0.9, weight_decay=0.01,
        nesterov=True))
    if hasattr(torch.optim, "Adafactor"):
        run("adafactor", lambda ps: torch.optim.Adafactor(
            [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.5}], lr=1e-2, weight_decay=0.01))
    else:
        print("# check adafactor: this PyTorch has no torch.optim.Adafactor", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("# bench_train_optim_torch: no CUDA device; nothing to measure")
        return 0
    dev = torch.device("cuda", 0)
    reps, warmup = args.reps, args.warmup
    print(f"# bench_train_optim_torch: PyTorch {torch.__version__} on {torch.cuda.get_device_name(0)}, "
          f"{TOTAL} parameters in {TENSORS} tensors, reps {reps}, warm-up {warmup}", flush=True)
    assert sum(optim_sizes()) == TOTAL

    nbytes = 256 << 20
    src = torch.rand(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    ms = median_ms(torch, lambda: dst.copy_(src), reps, warmup)
    d2d = 2.0 * nbytes / (ms * 1e-3) / 1e9
    print("BENCH " + json.dumps({"name": "optim_d2d_copy", "value": float(f"{d2d:.4g}"), "unit": "GB/s",
                                 "ms": round(ms, 4), "pct_d2d": 100.0}), flush=True)
    del src, dst
    check_against_torch(torch, dev)
    n = float(TOTAL)

    def make_params(dtype):
        ps = []
        for k in optim_sizes():
            p = (torch.randn(k, device=dev) * 0.02).to(dtype).requires_grad_(True)
            p.grad = (torch.randn(k, device=dev) * 1e-3).to(dtype)
            ps.append(p)
        return ps

    def run(name, bytes_per_step, fn):
        try:
            emit(name, bytes_per_step, median_ms(torch, fn, reps, warmup), d2d)
        except Exception as e:  # noqa: BLE001 - report and go on with the next case
            print("BENCH " + json.dumps({"name": name, "error": "failed"}) + f"\n# {e}", flush=True)

    ps = make_params(torch.float32)
    opt = torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, fused=True)
    run("optim_adamw_f32_100m", 28 * n, opt.step)
    del opt, ps
    torch.cuda.empty_cache()

    ps = make_params(torch.float32)
    try:
        opt = torch.optim.SGD(ps, lr=1e-3, momentum=0.9, fused=True)
    except (TypeError, RuntimeError):
        opt = torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=True)
    run("optim_sgd_momentum_f32_100m", 20 * n, opt.step)
    del opt, ps
    torch.cuda.empty_cache()

    ps = make_params(torch.bfloat16)
    masters = []
    for p in ps:
        m = p.detach().float().requires_grad_(True)
        m.grad = p.grad.float()
        masters.append(m)
    opt = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.01, fused=True)

    def master_step():
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in ps], [m.data for m in masters])

    run("optim_adamw_bf16_master_100m", 28 * n, master_step)
    del opt, ps, masters
    torch.cuda.empty_cache()

    ps = [p.detach() for p in make_params(torch.float32)]
    shadow = [p.clone() for p in ps]
    run("optim_ema_f32_100m", 12 * n, lambda: torch._foreach_lerp_(shadow, ps, 1.0 - 0.9999))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
