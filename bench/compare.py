#!/usr/bin/env python3
"""Joins the outputs of bench_ops (FLAME) and bench/bench_torch.py (PyTorch) into one table.

Each input holds lines "BENCH {json}" (other lines are ignored). For every benchmark the table
shows both values, each one's share of its own device-to-device copy bandwidth (memory-bound ops),
and "speed": FLAME's speed over PyTorch's (value ratio for rates, inverse ratio for times), so
above 1.00 means FLAME is faster and below means slower.

Usage: python3 bench/compare.py FLAME_OUTPUT TORCH_OUTPUT [--json OUT.json]
"""
import argparse
import json
import sys

ORDER = ["d2d_copy", "add", "mul", "gelu", "copy", "transpose_contiguous", "transpose_bf16", "transpose_fp8", "dequantize_fp8", "sum",
         "sum_columns", "softmax", "softmax_bf16", "gemm_bf16", "add_small_host", "add_small_gpu",
         "launch_empty_host", "launch_empty_gpu", "pool_alloc_free_host",
         "chain_fwd_nograd", "chain_fwd_record", "chain_bwd", "mlp_step"]
LOWER_IS_BETTER_UNITS = {"us/call", "ms"}


def load(path):
    results = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("BENCH "):
                    try:
                        rec = json.loads(line[len("BENCH "):])
                    except json.JSONDecodeError:
                        continue
                    results[rec.get("name", "?")] = rec
    except OSError as e:
        print(f"compare: cannot read {path}: {e}", file=sys.stderr)
    return results


def fmt_value(rec):
    if rec is None:
        return "-"
    if "error" in rec:
        return "error"
    v = rec["value"]
    return f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def fmt_pct(rec):
    if rec is None or "pct_d2d" not in rec:
        return ""
    return f"{rec['pct_d2d']:.0f}%"


def speed(f, t):
    if not f or not t or "error" in f or "error" in t or not f["value"] or not t["value"]:
        return None
    if f.get("unit") in LOWER_IS_BETTER_UNITS:
        return t["value"] / f["value"]
    return f["value"] / t["value"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("flame")
    ap.add_argument("torch")
    ap.add_argument("--json", help="also write the joined rows as JSON here")
    args = ap.parse_args()
    fl, th = load(args.flame), load(args.torch)
    names = [n for n in ORDER if n in fl or n in th] + sorted((set(fl) | set(th)) - set(ORDER))
    if not names:
        print("compare: no benchmark results found")
        return 1
    rows = []
    header = f"{'benchmark':<22}{'unit':<9}{'FLAME':>9}{'%d2d':>6}{'PyTorch':>10}{'%d2d':>6}{'speed':>8}"
    print(header)
    print("-" * len(header))
    for n in names:
        f, t = fl.get(n), th.get(n)
        unit = next((r["unit"] for r in (f, t) if r and "unit" in r), "")
        s = speed(f, t)
        print(f"{n:<22}{unit:<9}{fmt_value(f):>9}{fmt_pct(f):>6}{fmt_value(t):>10}{fmt_pct(t):>6}"
              f"{(f'{s:.2f}x' if s is not None else '-'):>8}")
        rows.append({"name": n, "unit": unit, "flame": f, "torch": t, "speed": s})
    for who, res in (("FLAME", fl), ("PyTorch", th)):
        for n in names:
            if n in res and "error" in res[n]:
                print(f"  {who} {n} error: {res[n]['error'][:200]}")
    print("speed = FLAME speed / PyTorch speed (above 1.00: FLAME faster); %d2d = share of the "
          "device-to-device copy rate")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
