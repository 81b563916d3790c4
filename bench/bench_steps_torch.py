#!/usr/bin/env python3
"""PyTorch twin of bench/bench_steps.cpp: whole training steps of the diffusion trainer's models
(apps/diffusion/reference/dit.py, unet.py: the same widths, layers and init as FLAME's) and the
4 x Linear(4096) MLP overhead probe, in PyTorch eager and with torch.compile(model) (default
mode; --compile-mode picks another, e.g. max-autotune-no-cudagraphs). Same names, shapes,
dtypes, settings and timing as the FLAME side (Note [Step benchmark method] in bench_steps.cpp):

  step = label dropout (p 0.1) -> rectified-flow loss under torch.autocast(bf16) -> backward ->
         clip_grad_norm_(1.0) -> AdamW(lr 1e-4, weight decay 0; fused=True like FLAME's fused
         AdamW, --adamw foreach for PyTorch's default) -> EMA (decay min(0.999, (1 + n) / (10 + n)), one foreach lerp)
  MLP    = 4 x Linear(4096, 4096), GELU between, batch 64, bf16 autocast, mse loss, backward, AdamW

The data batch is static on the GPU (randn images, random labels); the loss is not read. TF32 is
off for matmuls and cuDNN (FLAME's setting). torch.compile wraps the model only (the loss, the
optimizer and the EMA stay eager, as `torch.compile(model)` in a training script); its compile
time is spent in the warm-up and reported separately (compile_s). Peak memory is
torch.cuda.max_memory_allocated over the timed steps (reset after the warm-up). Eager runs also
count one step's FLOPs with torch.utils.flop_counter (flops_counted), a check of the analytic
count (flops) both sides use for MFU.

--device cpu is a smoke run (as bench_steps --device cpu): no autocast, host timing, no memory.

Usage: python3 bench/bench_steps_torch.py [--model dit-s,unet-s,mlp] [--batch N] [--steps N]
           [--warmup N] [--impl eager,compile] [--compile-mode MODE] [--no-gemm] [--device cuda|cpu]
"""
import argparse
import gc
import json
import os
import statistics
import sys
import time

from bench_timing import median_ms

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "apps", "diffusion", "reference"))

MLP_WIDTH, MLP_LAYERS = 4096, 4


def emit(rec):
    print("BENCH " + json.dumps(rec), flush=True)


def default_batch(model):
    if model.startswith("dit"):
        return 256
    if model.startswith("unet"):
        return 128
    return 64


# ---- Note [Model FLOPs] (bench_steps.cpp): matmul/conv FLOPs of a training step, 3 x forward ----

def dit_flops(c, batch):
    h, T, B, L = float(c.hidden), float(c.tokens), float(batch), float(c.depth)
    mlp = float(int(c.hidden * c.mlp_ratio))
    pp, C, f = float(c.patch_size ** 2), float(c.in_channels), float(c.frequency_dim)
    per_token = L * (3 * h * h + h * h + 2 * h * mlp) + C * pp * h + h * pp * C
    per_image = L * 6 * h * h + 2 * h * h + f * h + h * h
    attention = L * 4 * T * T * h
    return 3.0 * (2 * per_token * B * T + 2 * per_image * B + attention * B)


def unet_flops(c, batch):
    fwd = 0.0
    emb = float(c.emb_dim)

    def conv(cin, cout, k, r):
        nonlocal fwd
        fwd += 2 * cin * cout * k * k * r * r

    def res_block(cin, cout, r):
        nonlocal fwd
        conv(cin, cout, 3, r)
        conv(cout, cout, 3, r)
        if cin != cout:
            conv(cin, cout, 1, r)
        fwd += 2 * emb * cout

    levels = len(c.channel_mult)
    ch, res = [], []
    r = c.image_size
    for m in c.channel_mult:
        ch.append(float(c.base_channels * m))
        res.append(float(r))
        r = (r + 1) // 2
    cur = float(c.base_channels)
    conv(float(c.in_channels), cur, 3, res[0])
    for i in range(levels):
        res_block(cur, ch[i], res[i])
        cur = ch[i]
        if i + 1 < levels:
            conv(cur, cur, 3, res[i + 1])
    low = res[-1]
    n = low * low
    res_block(cur, cur, low)
    fwd += 2 * n * (3 * cur * cur + cur * cur) + 4 * n * n * cur
    res_block(cur, cur, low)
    for j in range(levels):
        out = ch[levels - 1 - j]
        res_block(cur + out, out, res[levels - 1 - j])
        cur = out
        if j + 1 < levels:
            conv(cur, cur, 3, res[levels - 2 - j])
    conv(cur, float(c.in_channels), 3, res[0])
    f = float(c.frequency_dim)
    fwd += 2 * (f * emb + emb * emb)
    return 3.0 * fwd * batch


def mlp_flops(batch):
    return 3.0 * 2.0 * MLP_LAYERS * MLP_WIDTH * MLP_WIDTH * batch


# ---- workloads: (name, batch, flops, step, model) ----

def adamw(torch, params, dev, impl):
    """torch.optim.AdamW(lr 1e-4, weight decay 0): fused (one kernel set for all parameters, as
    FLAME's fused AdamW) by default, or PyTorch's foreach default (--adamw foreach)."""
    kw = {"fused": True} if impl == "fused" and dev.type == "cuda" else {}
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, **kw)


def diffusion_workload(torch, preset, batch, dev, compile_fn, amp=True, opt_impl="fused"):
    from common import drop_labels
    from diffusion import flow_loss
    from unet import make_model
    model = make_model(preset).to(dev).train()
    if preset.startswith("dit"):
        from dit import dit_config
        flops = dit_flops(dit_config(preset), batch)
    else:
        from unet import unet_config
        flops = unet_flops(unet_config(preset), batch)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = adamw(torch, params, dev, opt_impl)
    ema = [p.detach().clone() for p in params]
    counter = [0]
    gen = torch.Generator(device=dev).manual_seed(17)
    data_gen = torch.Generator(device=dev).manual_seed(1)
    cfg = model.config
    s, c = getattr(cfg, "image_size", None) or cfg.input_size, cfg.in_channels
    images = torch.randn(batch, c, s, s, device=dev, generator=data_gen)
    labels = torch.randint(0, model.config.num_classes, (batch,), device=dev, generator=data_gen)
    fwd = compile_fn(model)

    def step():
        y = drop_labels(labels, 0.1, model.null_class, generator=gen)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            loss = flow_loss(fwd, images, y, generator=gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        d = min(0.999, (1 + counter[0]) / (10 + counter[0]))
        counter[0] += 1
        with torch.no_grad():
            torch._foreach_lerp_(ema, params, 1.0 - d)

    return f"step_{preset}_b{batch}", flops, step


def mlp_workload(torch, batch, dev, compile_fn, amp=True, opt_impl="fused"):
    import torch.nn as nn
    import torch.nn.functional as F
    layers = []
    for i in range(MLP_LAYERS):
        layers.append(nn.Linear(MLP_WIDTH, MLP_WIDTH))
        if i + 1 < MLP_LAYERS:
            layers.append(nn.GELU())
    model = nn.Sequential(*layers).to(dev)
    params = list(model.parameters())
    opt = adamw(torch, params, dev, opt_impl)
    data_gen = torch.Generator(device=dev).manual_seed(2)
    x = torch.randn(batch, MLP_WIDTH, device=dev, generator=data_gen)
    target = torch.randn(batch, MLP_WIDTH, device=dev, generator=data_gen)
    fwd = compile_fn(model)

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            loss = F.mse_loss(fwd(x), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return f"step_mlp4x4096_b{batch}", mlp_flops(batch), step


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "--models", default="dit-s,unet-s,mlp")
    ap.add_argument("--batch", type=int, default=0, help="0: each model's default (dit 256, unet 128, mlp 64)")
    ap.add_argument("--steps", "--reps", dest="reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--impl", default="eager,compile", help="eager, compile or both (comma-separated)")
    ap.add_argument("--compile-mode", default=None, help="torch.compile mode (default: PyTorch's default)")
    ap.add_argument("--no-gemm", action="store_true")
    ap.add_argument("--adamw", default="fused", choices=["fused", "foreach"],
                    help="torch.optim.AdamW implementation (default fused, like FLAME's)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (no autocast, host timing)")
    ap.add_argument("--no-flop-count", action="store_true",
                    help="skip the FlopCounterMode cross-check of the analytic FLOP count (eager runs)")
    args = ap.parse_args()
    import torch
    cpu = args.device == "cpu"
    if not cpu and not torch.cuda.is_available():
        print("# bench_steps_torch: no CUDA device; nothing to measure (--device cpu runs the CPU smoke test)")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cpu") if cpu else torch.device("cuda", 0)

    def sync():
        if not cpu:
            torch.cuda.synchronize()

    def time_steps(fn, reps):
        if not cpu:
            return median_ms(torch, fn, reps, 0)
        ms = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ms.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ms)

    impls = [s for s in args.impl.split(",") if s]
    models = [m for m in args.model.split(",") if m]
    print(f"# bench_steps_torch: PyTorch {torch.__version__} on {'cpu' if cpu else torch.cuda.get_device_name(0)}, "
          f"impl {','.join(impls)}, compile mode {args.compile_mode or 'default'}, AdamW {args.adamw}, TF32 off, "
          f"reps {args.reps}, warm-up {args.warmup}", flush=True)

    peak = 0.0
    if not args.no_gemm and not cpu:
        try:
            n = 8192
            a = torch.randn(n, n, device=dev).to(torch.bfloat16)
            b = torch.randn(n, n, device=dev).to(torch.bfloat16)
            ms = median_ms(torch, lambda: a @ b, 20, 3)
            peak = 2.0 * n ** 3 / (ms * 1e-3) / 1e12
            emit({"name": "gemm_peak_bf16", "value": float(f"{peak:.4g}"), "unit": "TFLOP/s", "ms": round(ms, 4),
                  "impl": "eager"})
            del a, b
        except Exception as e:  # report and go on
            emit({"name": "gemm_peak_bf16", "error": str(e)[:300], "impl": "eager"})
        torch.cuda.empty_cache()

    for impl in impls:
        if impl == "compile":
            kw = {"mode": args.compile_mode} if args.compile_mode else {}

            def compile_fn(m, kw=kw):
                return torch.compile(m, **kw)
            tag = "compile" if not args.compile_mode else f"compile:{args.compile_mode}"
        elif impl == "eager":
            def compile_fn(m):
                return m
            tag = "eager"
        else:
            print(f"# bench_steps_torch: unknown --impl {impl} (eager, compile)", flush=True)
            continue
        for model in models:
            batch = args.batch or default_batch(model)
            name = f"step_{model}_b{batch}" if model != "mlp" else f"step_mlp4x4096_b{batch}"
            try:
                if model == "mlp":
                    name, flops, step = mlp_workload(torch, batch, dev, compile_fn, amp=not cpu, opt_impl=args.adamw)
                else:
                    name, flops, step = diffusion_workload(torch, model, batch, dev, compile_fn, amp=not cpu,
                                                           opt_impl=args.adamw)
                counted = None
                if impl == "eager" and not args.no_flop_count:
                    # An independent check of the analytic count: PyTorch's FLOP counter over one step
                    # (it counts every matmul, conv and attention kernel, backward included).
                    try:
                        from torch.utils.flop_counter import FlopCounterMode
                        with FlopCounterMode(display=False) as fc:
                            step()
                        counted = fc.get_total_flops()
                    except Exception as e:  # an old PyTorch: no check, the benchmark goes on
                        print(f"# bench_steps_torch: no FLOP count for {name}: {e}", flush=True)
                sync()
                t0 = time.perf_counter()
                for _ in range(max(args.warmup, 1 if impl == "compile" else 0)):
                    step()
                sync()
                warm_s = time.perf_counter() - t0
                if not cpu:
                    torch.cuda.reset_peak_memory_stats()
                ms = time_steps(step, args.reps)
                tflops = flops / (ms * 1e-3) / 1e12
                rec = {"name": name, "value": round(ms, 4), "unit": "ms", "ms": round(ms, 4), "impl": tag,
                       "batch": batch, "img_s": round(batch / (ms * 1e-3), 1), "flops": float(f"{flops:.4g}"),
                       "tflops": round(tflops, 2)}
                if not cpu:
                    rec["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2 ** 20, 1)
                if impl == "compile":
                    rec["compile_s"] = round(warm_s, 1)
                if counted:
                    rec["flops_counted"] = float(f"{counted:.4g}")
                if peak > 0:
                    rec["mfu"] = round(tflops / peak, 4)
                emit(rec)
            except Exception as e:  # report and go on
                emit({"name": name, "error": f"{type(e).__name__}: {e}"[:300], "impl": tag})
            step = None
            if impl == "compile":
                torch._dynamo.reset()  # drops the compiled model (and its memory) before the next case
            gc.collect()
            if not cpu:
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
