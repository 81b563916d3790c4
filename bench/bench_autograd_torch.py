"""PyTorch twin of bench/bench_autograd.cpp: the y = y * c + d chain, forward without and with
recording and forward + backward, per op (2 ops per step), median over reps, same output lines.

Usage: python3 bench/bench_autograd_torch.py [--cpu] [--steps N] [--numel N] [--reps N]
"""
import argparse
import json
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--numel", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    dev = "cpu" if a.cpu else "cuda"
    g = torch.Generator(device="cpu").manual_seed(1234)
    x = torch.randn(a.numel, generator=g).to(dev)
    c = (torch.rand(a.numel, generator=g) * 0.02 + 0.99).to(dev)
    d = (torch.randn(a.numel, generator=g) * 0.01).to(dev)

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    def chain(cc, dd):
        y = x
        for _ in range(a.steps):
            y = y * cc + dd
        return y

    def median_us(fn):
        fn()
        fn()
        sync()
        t = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            fn()
            sync()
            t.append((time.perf_counter() - t0) * 1e6)
        t.sort()
        return t[len(t) // 2]

    ops = 2 * a.steps
    with torch.no_grad():
        fwd = median_us(lambda: chain(c, d))
    cg, dg = c.clone().requires_grad_(), d.clone().requires_grad_()
    fwd_rec = median_us(lambda: chain(cg, dg))
    seed = torch.ones(a.numel, device=dev)
    fwd_bwd = median_us(lambda: torch.autograd.grad(chain(cg, dg), [cg, dg], seed))
    for name, v in [("chain_fwd_norecord", fwd), ("chain_fwd_record", fwd_rec), ("chain_fwd_bwd", fwd_bwd),
                    ("chain_bwd_share", fwd_bwd - fwd_rec)]:
        print("BENCH " + json.dumps({"name": name, "device": dev, "numel": a.numel, "ops": ops,
                                     "us_per_op": round(v / ops, 4), "impl": "torch"}))


if __name__ == "__main__":
    main()
