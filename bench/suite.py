#!/usr/bin/env python3
"""FLAME's benchmark suite: every FLAME benchmark program and its PyTorch twin (eager, and
torch.compile where compiling can change the kernels), in one call, joined into ONE table.

  work | FLAME ms | PyTorch eager ms | ratio | torch.compile ms | ratio | rate | peak memory

ratio = FLAME time / PyTorch time (below 1.00: FLAME is faster). "rate" is FLAME's TFLOP/s or
GB/s (for training steps TFLOP/s and MFU against the bf16 GEMM rate of the same run). Peak memory
(MiB) where a case measures it (training steps, offload). "-" in the compile column: compiling
runs the same kernel as eager (a lone GEMM, attention, conv) so it is not measured.

Writes into --out: table.txt (the table, GPU and clocks at the top), results.json (machine,
every raw BENCH record, the joined rows), results.csv (the rows), ratios.png (bar chart of the
ratios; needs matplotlib) and logs.txt (every program's output, folded into one file).
--markdown FILE also writes the table as markdown (bench/RESULTS.md). --from-json re-renders the
outputs from an earlier results.json without running anything; --from-logs does the same from a
run's logs.txt alone (where results.json did not come back), --commit naming the measured commit.
docs/benchmarks.md has the method.

Exit status 1 when a program failed, timed out or was not built, or a case printed an error.

Usage:
  python3 bench/suite.py --build build-gpu --out OUT [--time-budget SECONDS] [--only FAMILY,..]
                         [--skip FAMILY,..] [--no-compile] [--markdown RESULTS.md] [--dry-run]
  python3 bench/suite.py --from-json OUT/results.json --out OUT [--markdown bench/RESULTS.md]
  python3 bench/suite.py --from-logs OUT/logs.txt [--commit HASH] --out OUT [--markdown ...]
"""
import argparse
import csv
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# Families: name -> (FLAME program in <build>/bench, PyTorch twin in bench/, the twin's arguments for
# its eager run, for its torch.compile run (None: compiling runs the same kernels, not measured)).
FAMILIES = {
    "steps": ("bench_steps", "bench_steps_torch.py", ["--impl", "eager"], ["--impl", "compile", "--no-gemm"]),
    "ops": ("bench_ops", "bench_torch.py", [], ["--compile"]),
    "nn_norm": ("bench_nn_norm", "bench_nn_norm_torch.py", [], ["--compile"]),
    "nn_attention": ("bench_nn_attention", "bench_nn_attention_torch.py", [], None),
    "nn_conv": ("bench_nn_conv", "bench_nn_conv_torch.py", [], None),
    "train_optim": ("bench_train_optim", "bench_train_optim_torch.py", [], None),
    "nn_pool": ("bench_nn_pool", "bench_nn_pool_torch.py", [], None),
    "nn_io": ("bench_nn_io", "bench_nn_io_torch.py", [], None),
    "train_amp": ("bench_train_amp", "bench_train_amp_torch.py", [], None),
    "train_offload": ("bench_train_offload", "bench_train_offload_torch.py", [], None),
}
# Extra arguments of FLAME programs: the steps also print where each step's memory peak went
# (logs.txt), for the memory target.
# The DiT step also with --recompute mlp (docs/recompute.md): the memory side of the trade.
FLAME_ARGS = {"steps": ["--memory-report", "--recompute", "none,mlp"]}
FLAME_GRAPH_ARGS = {"steps": ["--recompute", "none,mlp,mlp:9"]}
# The run order with each run's time limit in seconds: (family, side, nominal, reserved). A run's
# limit is its nominal one, cut so that the `reserved` seconds of every later run still fit in
# the budget; runs with nothing reserved (the optional families at the end) run only when time is
# left. The training steps go first (the targets); the torch.compile runs of the steps
# take what the budget leaves after reserving the essential op cases.
ORDER = [
    ("steps", "flame", 90, 40), ("steps", "flame_graph", 90, 40), ("steps", "eager", 90, 40),
    ("steps", "compile", 240, 60),
    ("ops", "flame", 75, 20), ("ops", "eager", 60, 20),
    ("nn_norm", "flame", 30, 10), ("nn_norm", "eager", 45, 15),
    ("nn_attention", "flame", 30, 10), ("nn_attention", "eager", 45, 15),
    ("nn_conv", "flame", 45, 10), ("nn_conv", "eager", 60, 15),
    # Attention and conv run the same cuDNN kernels on both sides, at the GPU's power cap: their
    # times drift a few percent with its power state, so they run in three alternating rounds
    # (FLAME, PyTorch, FLAME, ...) and each side's median round counts (Note [Alternating rounds]).
    # The third round comes last, so a short budget drops it before it drops a family.
    ("nn_attention", "flame", 30, 0), ("nn_attention", "eager", 45, 0),
    ("nn_conv", "flame", 45, 0), ("nn_conv", "eager", 60, 0),
    ("train_optim", "flame", 45, 10), ("train_optim", "eager", 60, 15),
    ("ops", "compile", 90, 20), ("nn_norm", "compile", 90, 20),
    ("nn_pool", "flame", 30, 0), ("nn_pool", "eager", 45, 0),
    ("nn_io", "flame", 30, 0), ("nn_io", "eager", 45, 0),
    ("train_amp", "flame", 30, 0), ("train_amp", "eager", 45, 0),
    ("train_offload", "flame", 45, 0), ("train_offload", "eager", 60, 0),
    ("nn_attention", "flame", 30, 0), ("nn_attention", "eager", 45, 0),
    ("nn_conv", "flame", 45, 0), ("nn_conv", "eager", 60, 0),
]

FIELDS = ["family", "work", "unit", "flame_ms", "eager_ms", "ratio_eager", "compile_ms", "ratio_compile",
          "rate", "rate_unit", "eager_rate", "compile_rate", "mfu", "img_s", "peak_mib_flame",
          "peak_mib_eager", "peak_mib_compile", "compile_s", "flops", "flops_counted", "rounds"]


# ---------------------------------------------------------------------------------- the machine

def sh(cmd, timeout=20):
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return r.stdout.strip() if r.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info():
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    q = ("name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.limit,"
         "temperature.gpu,pstate")
    line = sh(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"]).splitlines()
    if line:
        vals = [v.strip() for v in line[0].split(",")]
        info.update(dict(zip(q.split(","), vals)))
    # FLAME_COMMIT names the commit where the tree has no (or a stale) .git, e.g. a copied checkout.
    info["flame_commit"] = os.environ.get("FLAME_COMMIT") or sh(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"]) or "?"
    info["torch"] = sh([sys.executable, "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
                       timeout=60) or "not found"
    info["cpu_cores"] = os.cpu_count()
    return info


def machine_lines(info):
    gpu = info.get("name", "no GPU found (nvidia-smi)")
    out = [f"FLAME benchmark suite, {info.get('date', '?')}, FLAME {info.get('flame_commit', '?')}, "
           f"PyTorch {info.get('torch', '?')}"]
    if "note" in info:
        out.append(info["note"])
    elif "name" in info:
        out.append(f"GPU: {gpu}, driver {info.get('driver_version', '?')}, {info.get('memory.total', '?')}, "
                   f"power limit {info.get('power.limit', '?')}, {info.get('pstate', '?')}, "
                   f"{info.get('temperature.gpu', '?')} C")
        out.append(f"clocks: SM {info.get('clocks.sm', '?')} (max {info.get('clocks.max.sm', '?')}), memory "
                   f"{info.get('clocks.mem', '?')} (max {info.get('clocks.max.mem', '?')}) (at the start)")
    else:
        out.append(f"GPU: {gpu}")
    return out


# ---------------------------------------------------------------------------------- the runs

def plan(args):
    """The runs in order: dicts with family, side (flame/eager/compile), cmd, limit, min."""
    bench_dir = os.path.join(args.build, "bench")
    runs = []
    for fam, side, nominal, reserved in ORDER:
        if (args.only and fam not in args.only) or fam in args.skip:
            continue
        prog, twin, eager_args, compile_args = FAMILIES[fam]
        if side == "flame":
            cmd = [os.path.join(bench_dir, prog)] + FLAME_ARGS.get(fam, [])
        elif side == "flame_graph":  # the trainer's --compile step: one CUDA graph, fused chains
            cmd = [os.path.join(bench_dir, prog), "--mode", "graph"] + FLAME_GRAPH_ARGS.get(fam, [])
        elif side == "eager":
            cmd = [sys.executable, os.path.join(HERE, twin)] + eager_args
        else:
            if compile_args is None or args.no_compile:
                continue
            cmd = [sys.executable, os.path.join(HERE, twin)] + compile_args
            if args.compile_mode and fam == "steps":
                cmd += ["--compile-mode", args.compile_mode]
        runs.append({"family": fam, "side": side, "cmd": cmd, "limit": nominal, "min": reserved})
    return runs


def run_all(runs, args, log):
    """Runs every program with its time limit; returns the BENCH records of each run."""
    start = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("FLAME_KERNEL_CACHE", os.path.join(args.build, "kernel-cache"))
    for i, r in enumerate(runs):
        elapsed = time.monotonic() - start
        left = args.time_budget - elapsed if args.time_budget > 0 else 1e9
        reserve = sum(x["min"] for x in runs[i + 1:])
        limit = min(r["limit"], left - reserve)
        r["records"] = []
        if limit < r["min"]:
            limit = min(r["min"], left)  # a reserved run keeps its reserve
        if limit < 5:
            r["status"] = "skipped (time budget)"
            log.write(f"\n===== {r['family']} / {r['side']}: skipped, {left:.0f} s of the budget left\n")
            continue
        if not os.path.exists(r["cmd"][0] if r["side"] in ("flame", "flame_graph") else r["cmd"][1]):
            r["status"] = "missing"
            log.write(f"\n===== {r['family']} / {r['side']}: {r['cmd'][0]} not found\n")
            continue
        log.write(f"\n===== {r['family']} / {r['side']}: {shlex.join(r['cmd'])} (limit {limit:.0f} s)\n")
        log.flush()
        print(f"[suite {elapsed:5.0f}s] {r['family']:<14} {r['side']:<8} limit {limit:4.0f}s", flush=True)
        t0 = time.monotonic()
        out, rc = run_limited(r["cmd"], env, limit, os.path.join(args.out, f".run{i}.log"))
        r["seconds"] = round(time.monotonic() - t0, 1)
        r["status"] = f"rc {rc}"
        log.write(out)
        log.write(f"\n----- {r['family']} / {r['side']}: {r['status']} in {r['seconds']} s\n")
        log.flush()
        r["records"] = parse_records(out, r["side"])
    return runs


def run_limited(cmd, env, limit, path):
    """Runs cmd in its own process group with output to a file (no pipe a leftover child could hold
    open); on the time limit the whole group is killed. Returns (output, rc or "timeout")."""
    with open(path, "w+", encoding="utf-8", errors="replace") as f:
        try:
            p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            return f"suite: cannot start {cmd[0]}: {e}\n", "not started"
        try:
            rc = p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            p.wait()
            rc = "timeout"
        f.seek(0)
        out = f.read()
    try:
        os.remove(path)
    except OSError:
        pass
    return out, rc


def runs_from_logs(text, commit=""):
    """(machine info, runs) recovered from a run's logs.txt: its three header lines (machine_lines)
    and, per program, the output between its '=====' and '-----' lines."""
    lines = text.split("\n")
    info = {}
    m = re.match(r"FLAME benchmark suite, (.*?), FLAME (\S+), PyTorch (.*)$", lines[0] if lines else "")
    if not m:
        raise ValueError("not a bench/suite.py logs.txt (its first line is not the suite's header)")
    info.update(date=m.group(1), flame_commit=commit or m.group(2), torch=m.group(3))
    g = re.match(r"GPU: (.*?), driver (\S+), (.*?), power limit (.*?), (\S+), (\S+) C$", lines[1])
    if g:
        info.update({"name": g.group(1), "driver_version": g.group(2), "memory.total": g.group(3),
                     "power.limit": g.group(4), "pstate": g.group(5), "temperature.gpu": g.group(6)})
    c = re.match(r"clocks: SM (.*?) \(max (.*?)\), memory (.*?) \(max (.*?)\)", lines[2])
    if c:
        info.update({"clocks.sm": c.group(1), "clocks.max.sm": c.group(2), "clocks.mem": c.group(3),
                     "clocks.max.mem": c.group(4)})
    runs, cur, out = [], None, []
    for line in lines[3:]:
        start = re.match(r"===== (\S+) / (\S+): (.*) \(limit (\d+) s\)$", line)
        if start:
            cur = {"family": start.group(1), "side": start.group(2), "cmd": shlex.split(start.group(3)),
                   "limit": int(start.group(4)), "min": 0, "records": []}
            runs.append(cur)
            out = []
            continue
        end = re.match(r"----- (\S+) / (\S+): (.*) in ([\d.]+) s$", line)
        if end and cur is not None:
            cur.update(status=end.group(3), seconds=float(end.group(4)), records=parse_records("\n".join(out), cur["side"]))
            cur = None
            continue
        if cur is not None:
            out.append(line)
    return info, runs


def parse_records(text, side):
    recs = []
    for line in text.splitlines():
        if not line.startswith("BENCH "):
            continue
        try:
            rec = json.loads(line[len("BENCH "):])
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "name" in rec:
            rec["side"] = side
            recs.append(rec)
    return recs


# ---------------------------------------------------------------------------------- the table

def rec_ms(rec):
    if not rec or "error" in rec:
        return None
    if "ms" in rec:
        return float(rec["ms"])
    if rec.get("unit") == "ms":
        return float(rec["value"])
    if rec.get("unit") == "us/call":
        return float(rec["value"]) * 1e-3
    return None


def rec_rate(rec):
    if not rec or "error" in rec:
        return None, ""
    if "tflops" in rec:
        return float(rec["tflops"]), "TFLOP/s"
    if rec.get("unit") in ("GB/s", "TFLOP/s"):
        return float(rec["value"]), rec["unit"]
    return None, ""


# Note [Alternating rounds]
# A family listed more than once in ORDER gives each (case, side) one record per round; the row
# takes the median time of each side (the mean of the middle two for an even count), and "rounds"
# says how many rounds both sides completed (a budget cut can leave one side a round short). Rounds alternate FLAME and PyTorch, so a drift in the GPU's
# clocks (power cap, temperature) reaches both sides alike instead of favouring whichever ran first.
def median_record(recs):
    timed = sorted((r for r in recs if rec_ms(r) is not None), key=rec_ms)
    if not timed:
        return recs[-1]
    mid = timed[(len(timed) - 1) // 2]
    if len(timed) % 2 == 0:  # an even count: the mean of the middle two, not the faster one
        mid = dict(mid, ms=0.5 * (rec_ms(mid) + rec_ms(timed[len(timed) // 2])))
    return mid


def join(runs):
    """One row per (family, benchmark name), FLAME's order first."""
    by = {}
    order = []
    for r in runs:
        for rec in r.get("records", []):
            key = (r["family"], rec["name"])
            if key not in by:
                by[key] = {}
                order.append(key)
            by[key].setdefault(r["side"], []).append(rec)
    rows = []
    for fam, name in order:
        rounds = {s: len(v) for s, v in by[(fam, name)].items() if s in ("flame", "eager")}
        sides = {s: median_record(v) for s, v in by[(fam, name)].items()}
        # A FLAME-only variant of a step (step_<model>_b<batch>_recompute_<level>: the same model
        # and batch with activation recompute) is compared with the twin's rows of the step.
        base = name.split("_recompute_")[0]
        if base != name and (fam, base) in by:
            for s in ("eager", "compile"):
                if s not in sides and s in by[(fam, base)]:
                    sides[s] = median_record(by[(fam, base)][s])
        f, e, c = sides.get("flame"), sides.get("eager"), sides.get("compile")
        fm, em, cm = rec_ms(f), rec_ms(e), rec_ms(c)
        rate, unit = rec_rate(f)
        row = {"family": fam, "work": name, "unit": (f or e or c or {}).get("unit", ""),
               "flame_ms": fm, "eager_ms": em, "ratio_eager": fm / em if fm and em else None,
               "compile_ms": cm, "ratio_compile": fm / cm if fm and cm else None,
               "rate": rate, "rate_unit": unit, "eager_rate": rec_rate(e)[0], "compile_rate": rec_rate(c)[0],
               "mfu": (f or {}).get("mfu"), "img_s": (f or {}).get("img_s"),
               "peak_mib_flame": (f or {}).get("peak_mib"), "peak_mib_eager": (e or {}).get("peak_mib"),
               "peak_mib_compile": (c or {}).get("peak_mib"), "compile_s": (c or {}).get("compile_s"),
               "flops": (f or e or {}).get("flops"), "flops_counted": (e or {}).get("flops_counted"),
               "errors": {s: v["error"] for s, v in sides.items() if "error" in v},
               "rounds": min(rounds.values()) if rounds else 1}
        rows.append(row)
        g = sides.get("flame_graph")
        if g:  # the same work as a whole-step CUDA graph (bench_steps --mode graph)
            gm = rec_ms(g)
            grate, gunit = rec_rate(g)
            rows.append(dict(row, work=name + " [graph]", flame_ms=gm,
                             ratio_eager=gm / em if gm and em else None,
                             ratio_compile=gm / cm if gm and cm else None, rate=grate, rate_unit=gunit,
                             mfu=g.get("mfu"), img_s=g.get("img_s"), peak_mib_flame=g.get("peak_mib"),
                             errors={"flame_graph": g["error"]} if "error" in g else {}))
    return rows


# Issue #12's targets: (label, row name prefix, check(row) -> (value text, met or None)).
def _ratio_check(key, limit):
    def check(r):
        v = r.get(key)
        return (f"{v:.2f}x (target <= {limit}x)", v <= limit) if v is not None else ("not measured", None)
    return check


def _mem_check(r):
    f, c = r.get("peak_mib_flame"), r.get("peak_mib_compile")
    if f is None or c is None:
        return "not measured", None
    return f"{f / c:.2f}x ({f:.0f} / {c:.0f} MiB, target <= 0.8x)", f / c <= 0.8


def _mfu_check(r):
    v = r.get("mfu")
    return (f"{100 * v:.0f}% (target >= 50%)", v >= 0.5) if v is not None else ("not measured", None)


# A name ending in "+" takes the whole-step graph row ("[graph]", the trainer's default --compile)
# when the run has one, else the eager row.
TARGETS = [
    ("dit-s step time vs torch.compile", "step_dit-s_b256+", _ratio_check("ratio_compile", 0.8)),
    ("dit-s peak memory vs torch.compile", "step_dit-s_b256+", _mem_check),
    ("dit-s model FLOP utilisation", "step_dit-s_b256+", _mfu_check),
    ("dit-s eager step vs PyTorch eager", "step_dit-s_b256", _ratio_check("ratio_eager", 1.0)),
    ("unet-s step time vs torch.compile", "step_unet-s_b128+", _ratio_check("ratio_compile", 0.8)),
    ("MLP probe step vs PyTorch eager", "step_mlp4x4096_b64+", _ratio_check("ratio_eager", 0.5)),
]


def _both_line(rows):
    # Time and memory in one setting: every whole-step graph row of the DiT (plain and each
    # recompute variant), three decimals (0.8005x is not met).
    prefix, suffix = "step_dit-s_b256", " [graph]"
    label = "dit-s time and memory vs torch.compile in one setting (graph; time / memory, targets <= 0.8x)"
    parts, met = [], None
    for r in rows:
        w = r["work"]
        if not (w.startswith(prefix) and w.endswith(suffix)):
            continue
        t, f, c = r.get("ratio_compile"), r.get("peak_mib_flame"), r.get("peak_mib_compile")
        if t is None or not f or not c:
            continue
        ok = t <= 0.8 and f / c <= 0.8
        met = bool(met) or ok
        setting = w[len(prefix):-len(suffix)].lstrip("_").replace("recompute_", "recompute ") or "plain"
        parts.append(f"{setting} {t:.3f}x / {f / c:.3f}x" + (" (both)" if ok else ""))
    text = ", ".join(parts) if parts else "not measured"
    return f"{label}: {text} -> {'met' if met else 'NOT met' if met is False else '?'}"


def target_lines(rows):
    out = []
    for label, name, check in TARGETS:
        row = None
        if name.endswith("+"):
            name = name[:-1]
            row = next((r for r in rows if r["work"] == name + " [graph]" and r.get("flame_ms")), None)
            if row:
                label += " (graph)"
        row = row or next((r for r in rows if r["work"] == name), None)
        text, met = check(row) if row else ("not measured", None)
        out.append(f"{label}: {text} -> {'met' if met else 'NOT met' if met is False else '?'}")
    out.insert(2, _both_line(rows))
    return out


def flop_lines(rows):
    out = []
    for r in rows:
        if r.get("flops"):
            t = f"{r['work']}: {r['flops'] / 1e12:.3f} TFLOP analytic"
            if r.get("flops_counted"):
                t += f", {r['flops_counted'] / 1e12:.3f} counted by torch.utils.flop_counter"
            out.append(t)
    return out


def compile_lines(rows):
    return [f"{r['work']}: {r['compile_s']:.0f} s" for r in rows if r.get("compile_s") is not None]


def fmt(v, digits=3):
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    a = abs(v)
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.{digits}f}"


def cells(row):
    rate = "-"
    if row["rate"] is not None:
        rate = f"{fmt(row['rate'])} {row['rate_unit']}"
        if row.get("mfu") is not None:
            rate += f", MFU {100 * row['mfu']:.0f}%"
    peaks = [row.get(k) for k in ("peak_mib_flame", "peak_mib_eager", "peak_mib_compile")]
    peak = "-" if all(p is None for p in peaks) else " / ".join(fmt(p) if p is not None else "-" for p in peaks)
    err = "error" if row["errors"].get("flame") or row["errors"].get("flame_graph") else None

    def ratio(x):
        return f"{x:.2f}x" if x is not None else "-"
    return [row["work"], err or fmt(row["flame_ms"]),
            "error" if row["errors"].get("eager") else fmt(row["eager_ms"]), ratio(row["ratio_eager"]),
            "error" if row["errors"].get("compile") else fmt(row["compile_ms"]), ratio(row["ratio_compile"]),
            rate, peak]


HEAD = ["work", "FLAME ms", "eager ms", "ratio", "compile ms", "ratio", "FLAME TFLOP/s or GB/s",
        "peak MiB F/e/c"]


def rounds_line(rows):
    fams = sorted({(r["family"], r["rounds"]) for r in rows if r.get("rounds", 1) > 1})
    if not fams:
        return ""
    return ("alternating rounds (each side's median round; Note [Alternating rounds] in bench/suite.py): "
            + ", ".join(f"{f} {n}" for f, n in fams))


def text_table(rows, info, runs):
    lines = machine_lines(info) + [""]
    body = [cells(r) for r in rows]
    widths = [max(len(HEAD[i]), *(len(b[i]) for b in body)) if body else len(HEAD[i]) for i in range(len(HEAD))]
    fmt_line = "  ".join(f"{{:<{w}}}" if i == 0 or i == 6 or i == 7 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines.append(fmt_line.format(*HEAD))
    lines.append("-" * (sum(widths) + 2 * (len(widths) - 1)))
    fam = None
    for r, b in zip(rows, body):
        if r["family"] != fam:
            fam = r["family"]
            lines.append(f"[{fam}]")
        lines.append(fmt_line.format(*b))
    lines.append("")
    lines.append("ratio = FLAME time / PyTorch time (below 1.00x: FLAME faster); compile = torch.compile "
                 "(default mode); '-' = not measured (same kernel as eager, or not run)")
    if rounds_line(rows):
        lines.append(rounds_line(rows))
    lines.append("issue #12 targets (this run, FLAME eager):")
    lines += [f"  {t}" for t in target_lines(rows)]
    if compile_lines(rows):
        lines.append("torch.compile warm-up (compilation) per step case, not in the step times: "
                     + ", ".join(compile_lines(rows)))
    if flop_lines(rows):
        lines.append("model FLOPs per step (MFU uses the analytic count): " + "; ".join(flop_lines(rows)))
    for r in rows:
        for side, e in r["errors"].items():
            lines.append(f"  error {r['work']} ({side}): {str(e)[:160]}")
    for r in runs:
        if r.get("status") and r["status"] != "rc 0":
            lines.append(f"  run {r['family']} / {r['side']}: {r['status']}")
    return "\n".join(lines) + "\n"


def markdown(rows, info, runs, png_name):
    out = ["# FLAME benchmark results", "",
           "Generated by `python3 bench/suite.py --markdown bench/RESULTS.md` (docs/benchmarks.md explains "
           "the cases and the method); refresh it whenever performance work lands.", ""]
    out += [f"- {line}" for line in machine_lines(info)]
    out += ["", "ratio = FLAME time / PyTorch time (below 1.00x: FLAME faster). compile = `torch.compile` "
            "(default mode); `-` = not measured (the same kernel as eager) or not run. Peak memory in MiB: "
            "FLAME / PyTorch eager / torch.compile.", ""]
    out.append("| family | " + " | ".join(HEAD) + " |")
    out.append("|" + "---|" * (len(HEAD) + 1))
    for r in rows:
        out.append(f"| {r['family']} | " + " | ".join(c.replace("|", "/") for c in cells(r)) + " |")
    out.append("")
    if png_name:
        out += [f"![FLAME time / PyTorch time per case]({png_name})", ""]
    if rounds_line(rows):
        out += [rounds_line(rows)[0].upper() + rounds_line(rows)[1:] + ".", ""]
    out += ["Issue #12 targets in this run:", ""] + [f"- {t}" for t in target_lines(rows)] + [""]
    if compile_lines(rows):
        out += ["torch.compile warm-up (compilation, not in the step times): " + ", ".join(compile_lines(rows)), ""]
    if flop_lines(rows):
        out += ["Model FLOPs per step (MFU uses the analytic count): " + "; ".join(flop_lines(rows)), ""]
    notes = [f"- error {r['work']} ({s}): {str(e)[:160]}" for r in rows for s, e in r["errors"].items()]
    notes += [f"- run {r['family']} / {r['side']}: {r['status']}" for r in runs
              if r.get("status") and r["status"] != "rc 0"]
    if notes:
        out += ["Problems in this run:", ""] + notes + [""]
    out += ["Model-scale training steps (FLUX-dev, SD3.5-Large) are measured by the trainer's tools: "
            "bench/RESULTS-models.md.", ""]
    return "\n".join(out)


def write_csv(path, rows):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS + ["errors"])
        w.writeheader()
        for r in rows:
            d = {k: r.get(k) for k in FIELDS}
            d["errors"] = "; ".join(f"{s}: {str(e)[:120]}" for s, e in r["errors"].items())
            w.writerow(d)


def write_png(path, rows, info):
    """Horizontal bars: FLAME/eager and FLAME/compile time ratios per case (log scale, 1.0 marked)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker  # noqa: F401
    except ImportError:
        return "matplotlib not installed: no chart"
    sel = [r for r in rows if r["ratio_eager"] or r["ratio_compile"]]
    if not sel:
        return "no ratios to plot"
    n = len(sel)
    fig, ax = plt.subplots(figsize=(10, max(3.0, 0.28 * n + 1.5)))
    ys = list(range(n))
    h = 0.4
    # Bars grow from 1.0 (parity): left of it FLAME is faster, right of it slower.
    for off, key, label, color in ((-h / 2, "ratio_eager", "FLAME / PyTorch eager", "#4c72b0"),
                                   (h / 2, "ratio_compile", "FLAME / torch.compile", "#dd8452")):
        vals = [r[key] for r in sel]
        ax.barh([y + off for y, v in zip(ys, vals) if v], [v - 1.0 for v in vals if v], left=1.0, height=h,
                label=label, color=color)
        for y, v in zip(ys, vals):
            if v:
                ax.text(v, y + off, f" {v:.2f}", va="center", ha="left" if v >= 1 else "right", fontsize=6)
    ax.axvline(1.0, color="black", lw=1)
    ax.set_yticks(ys)
    ax.set_yticklabels([r["work"] for r in sel], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    lo = min(min(r[k] for k in ("ratio_eager", "ratio_compile") if r[k]) for r in sel)
    hi = max(max(r[k] for k in ("ratio_eager", "ratio_compile") if r[k]) for r in sel)
    x0, x1 = min(lo, 0.9) / 1.5, max(hi, 1.1) * 1.5
    ax.set_xlim(x0, x1)
    ax.set_xticks([t for t in (1 / 16, 1 / 8, 0.25, 0.5, 1, 2, 4, 8, 16, 32) if x0 <= t <= x1])
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("FLAME time / PyTorch time (log scale; below 1: FLAME faster)")
    ax.set_title(f"FLAME vs PyTorch, {info.get('name', '?')}, {info.get('date', '')}", fontsize=9)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def render(out_dir, info, runs, rows, markdown_path):
    os.makedirs(out_dir, exist_ok=True)
    table = text_table(rows, info, runs)
    with open(os.path.join(out_dir, "table.txt"), "w", encoding="utf-8") as f:
        f.write(table)
    with open(os.path.join(out_dir, "results.json"), "w", encoding="utf-8") as f:
        json.dump({"machine": info, "runs": runs, "rows": rows}, f, indent=1)
    write_csv(os.path.join(out_dir, "results.csv"), rows)
    png = os.path.join(out_dir, "ratios.png")
    why = write_png(png, rows, info)
    if why:
        print(f"suite: {why}")
    if markdown_path:
        os.makedirs(os.path.dirname(os.path.abspath(markdown_path)), exist_ok=True)
        png_ref = None
        if not why:
            # The chart goes beside the markdown (bench/RESULTS-ratios.png), so both can be committed.
            stem = os.path.splitext(os.path.basename(markdown_path))[0]
            png_ref = f"{stem}-ratios.png"
            shutil.copyfile(png, os.path.join(os.path.dirname(os.path.abspath(markdown_path)), png_ref))
        with open(markdown_path, "w", encoding="utf-8") as f:
            f.write(markdown(rows, info, runs, png_ref))
    return table


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--build", default="build-gpu", help="build directory holding bench/ programs")
    ap.add_argument("--out", default="suite-out", help="output directory")
    ap.add_argument("--time-budget", type=float, default=360.0, help="seconds for all runs (0: no budget)")
    ap.add_argument("--only", default="", help="families to run (comma-separated)")
    ap.add_argument("--skip", default="", help="families to leave out")
    ap.add_argument("--no-compile", action="store_true", help="no torch.compile runs")
    ap.add_argument("--compile-mode", default="",
                    help="torch.compile mode of the step runs (e.g. max-autotune-no-cudagraphs; default: default)")
    ap.add_argument("--markdown", default="", help="also write the table as markdown here")
    ap.add_argument("--from-json", default="", help="re-render from an earlier results.json; runs nothing")
    ap.add_argument("--from-logs", default="", help="re-render from an earlier run's logs.txt; runs nothing")
    ap.add_argument("--commit", default="", help="with --from-logs: the measured FLAME commit")
    ap.add_argument("--dry-run", action="store_true", help="list the runs and their limits; run nothing")
    args = ap.parse_args()
    args.only = [s for s in args.only.split(",") if s]
    args.skip = [s for s in args.skip.split(",") if s]
    bad = [s for s in args.only + args.skip if s not in FAMILIES]
    if bad:
        print(f"suite: unknown families {', '.join(bad)} (known: {', '.join(FAMILIES)})",
              file=sys.stderr)
        return 2

    if args.from_logs:
        with open(args.from_logs, encoding="utf-8", errors="replace") as f:
            info, runs = runs_from_logs(f.read(), args.commit)
        os.makedirs(args.out, exist_ok=True)
        print(render(args.out, info, runs, join(runs), args.markdown), end="")
        return 0
    if args.from_json:
        with open(args.from_json, encoding="utf-8") as f:
            data = json.load(f)
        runs = data.get("runs", [])
        rows = join(runs)
        print(render(args.out, data.get("machine", {}), runs, rows, args.markdown), end="")
        return 0

    runs = plan(args)
    if args.dry_run:
        print(f"suite: {len(runs)} runs, time budget {args.time_budget:.0f} s, build {args.build}")
        total = 0
        for r in runs:
            exe = r["cmd"][0] if r["side"] in ("flame", "flame_graph") else r["cmd"][1]
            there = "" if os.path.exists(exe) else "  (not built/found)"
            print(f"  {r['family']:<14} {r['side']:<8} limit {r['limit']:>4} s (reserved {r['min']:>3})  "
                  f"{shlex.join(r['cmd'])}{there}")
            total += r["limit"]
        print(f"suite: nominal limits add up to {total} s (caps: most runs take far less); the budget "
              "cuts the unreserved runs at the end first")
        if args.markdown:  # the template bench/RESULTS.md starts from
            info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                    "flame_commit": os.environ.get("FLAME_COMMIT") or sh(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"]) or "?",
                    "torch": "-",
                    "note": "GPU: not measured yet (template from --dry-run; the GPU run of bench/suite.py "
                            "fills in the table). Planned runs: "
                            + ", ".join(f"{r['family']}/{r['side']}" for r in runs)}
            os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
            with open(args.markdown, "w", encoding="utf-8") as f:
                f.write(markdown([], info, [], None))
            print(f"suite: template written to {args.markdown}")
        return 0

    os.makedirs(args.out, exist_ok=True)
    info = machine_info()
    for line in machine_lines(info):
        print(line, flush=True)
    with open(os.path.join(args.out, "logs.txt"), "w", encoding="utf-8") as log:
        log.write("\n".join(machine_lines(info)) + "\n")
        t0 = time.monotonic()
        run_all(runs, args, log)
        log.write(f"\nsuite: all runs in {time.monotonic() - t0:.0f} s\n")
    rows = join(runs)
    print(render(args.out, info, runs, rows, args.markdown), end="")
    print(f"suite: outputs in {args.out} (table.txt, results.json, results.csv, ratios.png, logs.txt)"
          + (f"; markdown {args.markdown}" if args.markdown else ""))
    # Exit status: 1 when a program failed, timed out or is missing, or a case reported an error
    # (runs skipped for the budget do not count).
    failed = [f"{r['family']}/{r['side']}: {r['status']}" for r in runs
              if r.get("status") not in ("rc 0", "skipped (time budget)")]
    errors = [f"{r['work']} ({s})" for r in rows for s in r["errors"]]
    if failed or errors:
        print(f"suite: {len(failed)} run(s) not clean ({'; '.join(failed)}), {len(errors)} case error(s)"
              + (f": {', '.join(errors[:10])}" if errors else ""))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
