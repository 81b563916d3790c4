#!/usr/bin/env python3
"""PyTorch twin of bench/bench_train_amp.cpp: one training step (forward, mse loss, backward, plain
SGD update p -= lr * g) of the same pre-norm transformer (4 layers, width 1024, 16 heads, seq 256,
batch 16; LayerNorm, fused qkv Linear, causal scaled_dot_product_attention, output Linear,
LayerNorm, MLP with GELU, residuals) in f32 and under torch.autocast(bf16). TF32 is off for
matmuls (torch.backends.cuda.matmul.allow_tf32 = False, PyTorch's default and FLAME's). Gradients
come from torch.autograd.grad (no accumulation into .grad), as FLAME's backward returns a fresh
store. Same names and timing (CUDA events between back-to-back steps, warm-up, median).
FLAME_BENCH_TRACE=1 also lists the kernels of one more step of each kind (torch.profiler).

Usage: python3 bench/bench_train_amp_torch.py [--reps N] [--warmup N]
"""
import argparse
import json
import os

from bench_timing import median_ms

LAYERS, WIDTH, HEADS, SEQ, BATCH = 4, 1024, 16, 256, 16


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    if not torch.cuda.is_available():
        print("# bench_train_amp_torch: no CUDA device; nothing to measure")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda", 0)
    print(f"# bench_train_amp_torch: PyTorch {torch.__version__} on {torch.cuda.get_device_name(0)}, "
          f"TF32 off, reps {args.reps}, warm-up {args.warmup}", flush=True)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(WIDTH)
            self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
            self.proj = nn.Linear(WIDTH, WIDTH)
            self.ln2 = nn.LayerNorm(WIDTH)
            self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
            self.act = nn.GELU()
            self.fc2 = nn.Linear(4 * WIDTH, WIDTH)

        def forward(self, x):
            b, s, _ = x.shape
            t = self.qkv(self.ln1(x)).view(b, s, 3, HEADS, WIDTH // HEADS)
            q, k, v = (t.select(2, i).transpose(1, 2) for i in range(3))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = x + self.proj(a.transpose(1, 2).reshape(b, s, WIDTH))
            return h + self.fc2(self.act(self.fc1(self.ln2(h))))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.ln_f = nn.LayerNorm(WIDTH)

        def forward(self, x):
            for blk in self.blocks:
                x = blk(x)
            return self.ln_f(x)

    torch.manual_seed(0)
    model = Model().to(dev)
    params = list(model.parameters())
    x = torch.randn(BATCH, SEQ, WIDTH, device=dev)
    target = torch.randn(BATCH, SEQ, WIDTH, device=dev)
    lr = 1e-4

    def step(autocast):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = F.mse_loss(model(x), target)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.add_(g, alpha=-lr)

    names = ["train_step_transformer_fp32", "train_step_transformer_bf16_autocast"]
    ms = [0.0, 0.0]
    for i, name in enumerate(names):
        ms[i] = median_ms(torch, lambda: step(i == 1), args.reps, args.warmup)
        rec = {"name": name, "value": round(ms[i], 4), "unit": "ms"}
        if i == 1:
            rec["speedup"] = round(ms[0] / ms[1], 3)
        print("BENCH " + json.dumps(rec), flush=True)
        if os.environ.get("FLAME_BENCH_TRACE"):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                step(i == 1)
                torch.cuda.synchronize()
            print(f"# kernels of one {name} step:")
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25,
                                            max_name_column_width=100))
    print(f"# bench_train_amp_torch: bf16 autocast step {ms[0] / ms[1]:.2f}x faster than fp32", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
