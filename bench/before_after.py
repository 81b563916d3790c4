#!/usr/bin/env python3
"""FLAME against FLAME: the same benchmark programs from two builds (two commits) on one machine,
in one sitting, joined into one table. For a change that must keep performance (a refactor), the
table is its evidence: every case's value before and after, and after / before.

The programs run alternately, one build then the other, the order flipping from one program to
the next and from one round to the next, so that clock and thermal drift over the sitting falls on
both sides alike; each case's value is the median over the rounds. Times (ms, us/call) are better lower, rates (GB/s, TFLOP/s)
higher: "after/before" is the time ratio either way (below 1.00: the after build is faster).

  python3 bench/before_after.py --before BUILD_A --after BUILD_B --out DIR
                                [--programs bench_ops,bench_autograd,...] [--rounds 2]
                                [--budget SECONDS] [--program-timeout SECONDS]
                                [--before-name NAME] [--after-name NAME]

Writes DIR/table.md (the markdown table), DIR/results.json (every record of every run) and
DIR/logs.txt (every run's output). Exit status 1 when a program failed or timed out.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import suite  # bench/suite.py: the BENCH record format

DEFAULT_PROGRAMS = ["bench_ops", "bench_autograd", "bench_compile", "bench_nn_norm", "bench_nn_conv",
                    "bench_nn_pool", "bench_nn_attention", "bench_steps"]
LOWER_IS_BETTER = {"ms", "us/call", "us", "ns/call"}


def records(text):
    """The BENCH records of a program's output, those that measured something."""
    return [r for r in suite.parse_records(text, "flame") if "error" not in r]


# The measured fields of a record (the rest describe the case): (key, unit); "value" carries its
# own unit. A record may carry several (a step's ms and peak MiB).
METRICS = [("value", None), ("ms", "ms"), ("us_per_op", "us/op"), ("allocs_per_op", "allocs/op"),
           ("recorded_us_per_op", "us/op"), ("recorded_allocs_per_op", "allocs/op"), ("peak_mib", "MiB"),
           ("img_s", "img/s")]
LOWER_IS_BETTER |= {"us/op", "allocs/op", "MiB"}


def metrics(rec):
    """(label, unit, value) of each measured field of a record."""
    out = []
    for key, unit in METRICS:
        v = rec.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if key == "value":
                out.append((rec["name"], rec.get("unit", ""), float(v)))
            elif not (key == "ms" and rec.get("unit") == "ms"):  # the same number as value
                out.append((f"{rec['name']} ({key})", unit, float(v)))
    return out


def run(build, program, timeout, log):
    path = os.path.join(build, "bench", program)
    if not os.path.exists(path):
        log.write(f"==== {path}: not built\n")
        return None, "not built"
    t0 = time.time()
    try:
        p = subprocess.run([path], capture_output=True, text=True, timeout=timeout)
        text, status = p.stdout + p.stderr, ("ok" if p.returncode == 0 else f"exit {p.returncode}")
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        status = f"timed out after {timeout} s"
    log.write(f"==== {path} ({status}, {time.time() - t0:.0f} s)\n{text}\n")
    log.flush()
    return records(text), status


def ratio(before, after, unit):
    """after / before as a time ratio (below 1: after is faster)."""
    if not before or not after:
        return None
    return after / before if unit in LOWER_IS_BETTER else before / after


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="build directory of the earlier commit")
    ap.add_argument("--after", required=True, help="build directory of the later commit")
    ap.add_argument("--out", required=True)
    ap.add_argument("--programs", default=",".join(DEFAULT_PROGRAMS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget", type=float, default=0.0, help="seconds for all runs (0: none); later runs are skipped")
    ap.add_argument("--program-timeout", type=float, default=120.0)
    ap.add_argument("--before-name", default="before")
    ap.add_argument("--after-name", default="after")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    programs = [p for p in args.programs.split(",") if p]
    sides = [("before", args.before), ("after", args.after)]
    values = {}  # (program, name) -> {"unit": u, "before": [..], "after": [..]}
    failures, raw = [], []
    t_start = time.time()
    with open(os.path.join(args.out, "logs.txt"), "w") as log:
        for rnd in range(args.rounds):
            for i, prog in enumerate(programs):
                for side, build in (sides if (rnd + i) % 2 == 0 else sides[::-1]):
                    left = args.budget - (time.time() - t_start) if args.budget else args.program_timeout
                    if left < 5:
                        failures.append(f"{prog} ({side}, round {rnd + 1}): skipped, budget spent")
                        continue
                    recs, status = run(build, prog, min(args.program_timeout, left), log)
                    if status != "ok":
                        failures.append(f"{prog} ({side}, round {rnd + 1}): {status}")
                    for rec in recs or []:
                        raw.append({"program": prog, "side": side, "round": rnd + 1, **rec})
                        for label, unit, value in metrics(rec):
                            v = values.setdefault((prog, label), {"unit": unit, "before": [], "after": []})
                            v[side].append(value)
    lines = [f"| program | case | unit | {args.before_name} | {args.after_name} | after/before |",
             "| --- | --- | --- | --- | --- | --- |"]
    ratios = []
    for (prog, name), v in values.items():
        b = statistics.median(v["before"]) if v["before"] else None
        a = statistics.median(v["after"]) if v["after"] else None
        r = ratio(b, a, v["unit"])
        if r is not None:
            ratios.append(r)
        fmt = lambda x: "-" if x is None else (f"{x:.1f}" if abs(x) >= 10 else f"{x:.3g}")
        lines.append(f"| {prog} | {name} | {v['unit']} | {fmt(b)} | {fmt(a)} | {'-' if r is None else f'{r:.2f}'} |")
    summary = ""
    if ratios:
        gm = statistics.geometric_mean(ratios)
        summary = (f"{len(ratios)} cases; after/before: geometric mean {gm:.3f}, median {statistics.median(ratios):.3f}, "
                   f"best {min(ratios):.2f}, worst {max(ratios):.2f}")
    table = "\n".join(lines) + "\n\n" + summary + "\n"
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(table)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"before": args.before_name, "after": args.after_name, "records": raw, "failures": failures}, f)
    print(table)
    for msg in failures:
        print("before_after:", msg, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
