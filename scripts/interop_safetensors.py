#!/usr/bin/env python3
"""Two-way safetensors check between FLAME and Python's safetensors (+ PyTorch).

  python3 scripts/interop_safetensors.py --flame-bin build/examples/safetensors_interop [--device cuda]

(a) Python writes tensors of every dtype (random values, odd shapes, a 0-d and an empty tensor,
    NaN/inf/-0/subnormals) plus metadata; FLAME loads them onto the device and checks dtype,
    shape and a hash of the bytes, then saves them again from the device; Python compares that
    file's tensors and metadata with its own bit for bit.
(b) FLAME writes tensors of every dtype (made on the device, one non-contiguous); Python loads
    them with safetensors.torch and compares dtype, shape and bytes with FLAME's manifest.
(c) A small PyTorch model (mlp = Linear -> GELU -> Linear, then LayerNorm) is saved with its
    state_dict names, input and output; FLAME loads it, runs the same forward and must match.

Without PyTorch, (a) and (b) run with safetensors.numpy (no BF16) and (c) is skipped.
Exits non-zero on any mismatch. Prints `INTEROP <step>: PASS|FAIL|SKIP ...` lines.
"""
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

try:
    import torch
    from safetensors.torch import load_file as torch_load, save_file as torch_save
except ImportError:  # numpy only
    torch = None
from safetensors import safe_open
from safetensors.numpy import load_file as np_load, save_file as np_save

FNV_OFFSET, FNV_PRIME = 0xCBF29CE484222325, 0x100000001B3


def fnv(data: bytes) -> str:
    x = FNV_OFFSET
    # Vectorised enough for the small tensors used here.
    for b in data:
        x = ((x ^ b) * FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return f"{x:016x}"


def to_bytes(t) -> bytes:
    if torch is not None and isinstance(t, torch.Tensor):
        t = t.detach().cpu().contiguous()
        if t.numel() == 0:
            return b""
        return t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(t).tobytes()


def st_dtype(t) -> str:
    if torch is not None and isinstance(t, torch.Tensor):
        return {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}[t.dtype]
    return {np.dtype("float64"): "F64", np.dtype("float32"): "F32", np.dtype("float16"): "F16",
            np.dtype("int64"): "I64", np.dtype("int32"): "I32", np.dtype("uint8"): "U8",
            np.dtype("bool"): "BOOL"}[t.dtype]


def dims(t) -> str:
    shape = tuple(t.shape)
    return ",".join(str(d) for d in shape) if shape else "-"


def make_tensors(rng):
    """Random tensors of every dtype FLAME has (torch) or numpy has (no BF16)."""
    out = {}
    shapes = {"odd": (3, 5, 7), "scalar": (), "empty": (0, 4), "row": (1, 13)}
    floats = ["F64", "F32", "F16"] + (["BF16"] if torch is not None else [])
    for kind, shape in shapes.items():
        for d in floats:
            v = rng.standard_normal(shape) * 4.0
            a = v.astype({"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.float32}[d])
            out[f"{kind}.{d}"] = ("f", d, a)
        out[f"{kind}.I64"] = ("i", "I64", rng.integers(-2**62, 2**62, size=shape, dtype=np.int64))
        out[f"{kind}.I32"] = ("i", "I32", rng.integers(-2**31, 2**31 - 1, size=shape, dtype=np.int32))
        out[f"{kind}.U8"] = ("i", "U8", rng.integers(0, 256, size=shape, dtype=np.uint8))
        out[f"{kind}.BOOL"] = ("b", "BOOL", rng.random(shape) < 0.5)
    out["special.F32"] = ("f", "F32", np.array([-0.0, np.inf, -np.inf, np.nan, 1e-40, 3.0], dtype=np.float32))
    out["special.F16"] = ("f", "F16", np.array([-0.0, np.inf, np.nan, 6e-8, 65504.0], dtype=np.float16))
    result = {}
    for name, (_, d, a) in out.items():
        if torch is not None:
            t = torch.from_numpy(np.array(a, order="C"))
            if d == "BF16":
                t = t.to(torch.bfloat16)
            result[name] = t.contiguous()
        else:
            result[name] = np.array(a, order="C")  # keeps 0-d (ascontiguousarray makes it 1-d)
    return result


def load_any(path):
    return torch_load(path) if torch is not None else np_load(path)


def save_any(tensors, path, metadata):
    if torch is not None:
        torch_save(tensors, path, metadata=metadata)
    else:
        np_save(tensors, path, metadata=metadata)


def metadata_of(path):
    framework = "pt" if torch is not None else "np"
    with safe_open(path, framework=framework) as f:
        return f.metadata() or {}


def run(cmd, timeout):
    print("+", " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    sys.stdout.write(p.stdout)
    sys.stderr.write(p.stderr)
    return p.returncode


def step_a(args, work, rng):
    tensors = make_tensors(rng)
    meta = {"format": "pt", "epoch": "7", "utf8": "\u03bb=0.5"}
    save_any(tensors, os.path.join(work, "py_all.safetensors"), meta)
    with open(os.path.join(work, "py_manifest.txt"), "w", encoding="utf-8") as f:
        for name, t in tensors.items():
            f.write(f"tensor\t{name}\t{st_dtype(t)}\t{dims(t)}\t{fnv(to_bytes(t))}\n")
        for k, v in meta.items():
            f.write(f"meta\t{k}\t{v}\n")
    if run([args.flame_bin, "read", work, args.device], args.timeout) != 0:
        return False, "FLAME's check of the Python file failed"
    back = load_any(os.path.join(work, "flame_resaved.safetensors"))
    bad = []
    if set(back) != set(tensors):
        bad.append(f"names differ: {sorted(set(back) ^ set(tensors))}")
    for name, t in tensors.items():
        if name in back:
            b = back[name]
            if st_dtype(b) != st_dtype(t) or tuple(b.shape) != tuple(t.shape) or to_bytes(b) != to_bytes(t):
                bad.append(name)
    if metadata_of(os.path.join(work, "flame_resaved.safetensors")) != meta:
        bad.append("metadata")
    if bad:
        return False, f"FLAME's re-saved file differs: {bad[:10]}"
    return True, f"{len(tensors)} tensors Python -> FLAME ({args.device}) -> Python bit-exact, metadata kept"


def step_b(args, work):
    if run([args.flame_bin, "write", work, args.device], args.timeout) != 0:
        return False, "FLAME's write failed"
    path = os.path.join(work, "flame_all.safetensors")
    want, want_meta = {}, {}
    with open(os.path.join(work, "flame_manifest.txt"), encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if parts[0] == "tensor":
                want[parts[1]] = parts[2:]
            elif parts[0] == "meta":
                want_meta[parts[1]] = parts[2]
    skipped = []
    if torch is None:  # numpy has no bfloat16: read the others one by one
        got = {}
        with safe_open(path, framework="np") as f:
            for name in f.keys():
                if want.get(name, [""])[0] == "BF16":
                    skipped.append(name)
                    continue
                got[name] = f.get_tensor(name)
    else:
        got = torch_load(path)
    bad = []
    if set(got) | set(skipped) != set(want):
        bad.append("names differ")
    for name, (dt, dm, h) in want.items():
        if name in skipped:
            continue
        t = got.get(name)
        if t is None or st_dtype(t) != dt or dims(t) != dm or fnv(to_bytes(t)) != h:
            bad.append(name)
    if metadata_of(path) != want_meta:
        bad.append("metadata")
    if bad:
        return False, f"Python's read of FLAME's file differs: {bad[:10]}"
    note = f" ({len(skipped)} BF16 tensors not checked: numpy has no bfloat16)" if skipped else ""
    return True, f"{len(want) - len(skipped)} tensors FLAME ({args.device}) -> Python bit-exact, metadata kept{note}"


def step_c(args, work):
    if torch is None:
        return None, "PyTorch is not installed"
    torch.manual_seed(0)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = torch.nn.Sequential(torch.nn.Linear(37, 64), torch.nn.GELU(), torch.nn.Linear(64, 19))
            self.norm = torch.nn.LayerNorm(19)

        def forward(self, x):
            return self.norm(self.mlp(x))

    model = Model().eval()
    with torch.no_grad():  # non-trivial LayerNorm parameters
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
        x = torch.randn(9, 37)
        y = model(x)
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    sd["input"], sd["output"] = x, y
    torch_save(sd, os.path.join(work, "mlp.safetensors"), metadata={"format": "pt"})
    if run([args.flame_bin, "mlp", work, args.device], args.timeout) != 0:
        return False, "FLAME's forward of the PyTorch model does not match"
    return True, f"PyTorch MLP+LayerNorm ({', '.join(k for k in sd if '.' in k)}) reproduced by FLAME on {args.device}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flame-bin", required=True, help="path of the safetensors_interop example binary")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--timeout", type=int, default=120, help="seconds for each FLAME run")
    args = ap.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="flame_interop_")
    os.makedirs(work, exist_ok=True)
    rng = np.random.default_rng(1234)
    print(f"interop: safetensors {__import__('safetensors').__version__}, "
          f"torch {torch.__version__ if torch is not None else 'absent (numpy only)'}, device {args.device}, "
          f"files in {work}")
    ok = True
    for label, fn in [("a", lambda: step_a(args, work, rng)), ("b", lambda: step_b(args, work)),
                      ("c", lambda: step_c(args, work))]:
        try:
            passed, what = fn()
        except Exception as e:  # a crash of one step is that step's failure
            passed, what = False, f"{type(e).__name__}: {e}"
        status = "SKIP" if passed is None else ("PASS" if passed else "FAIL")
        print(f"INTEROP {label}: {status} {what}", flush=True)
        ok = ok and passed is not False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
