#!/usr/bin/env python3
"""Checks that #include lines between FLAME's parts point one way (Note [Layers] in docs/design.md).

Every file under src/ and include/flame/ belongs to one layer; a file may include headers of its
own layer and of the layers below it, never above. The layers and what belongs to each are
written once, in LAYERS below. The check fails on any upward include not listed in KNOWN (empty:
there are none), and on a KNOWN entry that no longer exists.

    python3 tools/check_layers.py            # exit 0: no new upward include
    python3 tools/check_layers.py --list     # every file's layer, and the counts
"""
import argparse
import fnmatch
import os
import re
import sys

# Lowest first. Patterns are fnmatch globs over paths relative to the repository root; the first
# layer with a matching pattern owns the file.
LAYERS = [
    # Values and storage: dtype, device, errors, the Tensor class and its impl, memory, RNG math.
    ("core", ["include/flame/dtype.h", "include/flame/half.h", "include/flame/float8.h", "include/flame/device.h",
              "include/flame/error.h", "include/flame/scalar.h", "include/flame/macros.h",
              "include/flame/version.h", "include/flame/tensor.h", "include/flame/indexing.h", "include/flame/op_table.h",
              "include/flame/state_dict.h", "include/flame/stateful.h", "include/flame/cuda.h", "include/flame/grad_mode.h",
              "include/flame/cpu.h", "src/core/*",
              # random.h holds values only: the Generator's (seed, offset) state and the host
              # HostRng; the random ops that draw from them are the op layer's (src/ops/random.cpp).
              "include/flame/random.h"]),
    # Op definitions: the op list, scalar functors, derivative tables, shape and dtype rules, the
    # counter-based RNG's math.
    ("opdef", ["src/opdef/*", "src/random/philox.h"]),
    # Kernels: the CPU and CUDA backends and their tuning; the custom-kernel API they implement.
    ("kernels", ["src/backend/*", "include/flame/cuda/kernels.h"]),
    # The ops users call (entry points that validate, dispatch and record).
    # The functional nn headers (F::conv2d, F::layer_norm, ...) declare ops too.
    ("ops", ["include/flame/ops.h", "src/ops/*", "src/random/*",
             "include/flame/nn/args.h", "include/flame/nn/adaln.h", "include/flame/nn/attention.h",
             "include/flame/nn/conv.h", "include/flame/nn/norm.h", "include/flame/nn/pool.h",
             "include/flame/nn/linear_gelu.h", "include/flame/nn/linear_float8.h", "include/flame/nn/rotary.h"]),
    # What consumes op definitions: autograd, compile, autocast, the profiler.
    ("transforms", ["include/flame/autograd.h", "include/flame/anomaly.h", "include/flame/recompute.h",
                    "include/flame/amp.h", "include/flame/compile.h", "include/flame/profiler.h",
                    "include/flame/saved_tensor_hooks.h",
                    "src/autograd/*", "src/amp/*", "src/compile/*", "src/profiler/*"]),
    # Libraries on top: layers, optimizers, training tools, data, files, devices, distributed.
    ("library", ["include/flame/*", "src/nn/*", "src/optim/*", "src/train/*", "src/data/*", "src/io/*",
                 "src/dist/*", "src/memory/*"]),
]

# Upward includes allowed for now, as "from -> to": none. An entry may only be added with the work
# that removes it in view, and the check fails once it no longer exists, so the list only shrinks.
KNOWN = """
""".split("\n")

INCLUDE = re.compile(r'^\s*#\s*include\s+"((?:src|flame)/[^"]+)"', re.M)


def layer_of(path):
    for i, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatch(path, p) for p in patterns):
            return i
    return None


def resolve(inc):
    return "include/" + inc if inc.startswith("flame/") else inc


def files(root):
    for top in ("src", "include/flame"):
        for d, _, names in os.walk(os.path.join(root, top)):
            for n in names:
                if n.endswith((".h", ".hpp", ".cpp", ".cu", ".cuh", ".inc")):
                    yield os.path.relpath(os.path.join(d, n), root)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    ap.add_argument("--list", action="store_true", help="print every file's layer and the counts")
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    names = [n for n, _ in LAYERS]
    unplaced, upward = [], []
    count = [0] * len(LAYERS)
    for f in sorted(files(root)):
        lf = layer_of(f)
        if lf is None:
            unplaced.append(f)
            continue
        count[lf] += 1
        if args.list:
            print(f"{names[lf]:10} {f}")
        with open(os.path.join(root, f), encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        for inc in INCLUDE.findall(text):
            target = resolve(inc)
            lt = layer_of(target)
            if lt is None:
                unplaced.append(f"{target} (included by {f})")
            elif lt > lf:
                upward.append(f"{f} -> {target}")
    known = {k.strip() for k in KNOWN if k.strip()}
    new = [u for u in upward if u not in known]
    gone = sorted(known - set(upward))
    if args.list:
        print("files per layer: " + ", ".join(f"{n} {c}" for n, c in zip(names, count)))
    ok = True
    if unplaced:
        ok = False
        print("check_layers: files in no layer (add them to LAYERS in tools/check_layers.py):")
        for u in unplaced:
            print("  " + u)
    if new:
        ok = False
        print(f"check_layers: {len(new)} include(s) point up a layer (layers, lowest first: {' < '.join(names)}):")
        for u in new:
            a, b = u.split(" -> ")
            print(f"  {u}   ({names[layer_of(a)]} includes {names[layer_of(b)]})")
        print("Move the shared part down a layer, or reach the higher layer through a hook it registers.")
    if gone:
        ok = False
        print("check_layers: KNOWN entries that no longer exist (delete them from KNOWN):")
        for g in gone:
            print("  " + g)
    print(f"check_layers: {len(upward)} upward include(s), {len(known)} known; "
          f"{'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
