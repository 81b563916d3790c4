#!/usr/bin/env python3
"""Interop check between FLAME's diffusion models and their PyTorch twins (dit.py, unet.py).

For each preset, both directions:
  torch -> FLAME: the twin (torch init + N(0, 0.02) noise on every parameter, so the zero-initialised
                  layers matter) is saved as safetensors; diffusion_interop loads it strictly, runs the
                  forward on the same inputs; outputs are compared with the twin's.
  FLAME -> torch: diffusion_interop init --perturb 0.02 writes FLAME's weights; the twin loads them
                  with load_state_dict(strict=True) and both forwards are compared again.
With --trained, each preset is also trained for a few hundred steps on each side (reference/
train.py; flame-diffusion train + export), and the other side loads the trained weights, gives the
same forward, and (FLAME) samples a grid from them; a fixed-batch loss well below a fresh model's
shows the weights are trained.
Also: the state-dict keys, their order and shapes are identical, and FLAME's fresh init follows the
same scheme as the twin's (same zero tensors, same pos_embed table, per-tensor std within 15%).

Exits 1 on any mismatch. Needs torch and safetensors:
  python3 apps/diffusion/reference/interop.py --bin build/apps/diffusion/diffusion_interop --device cuda
"""
import argparse
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from unet import make_model  # noqa: E402  (covers the DiT presets too)

DEFAULT_MODELS = "dit-tiny,unet-tiny,dit-s,unet-s"


def run_bin(binary, *args):
    cmd = [binary, *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}{r.stderr}")
    return r.stdout


def compare(name, got, ref, rtol, atol):
    """max|got - ref| <= atol + rtol * max|ref|; prints the numbers either way."""
    got = got.detach().double().cpu()
    ref = ref.detach().double().cpu()
    if got.shape != ref.shape:
        print(f"  FAIL {name}: shape {tuple(got.shape)} vs {tuple(ref.shape)}")
        return False
    scale = ref.abs().max().item()
    err = (got - ref).abs().max().item()
    mean_rel = ((got - ref).abs().mean() / ref.abs().mean().clamp_min(1e-30)).item()
    ok = err <= atol + rtol * scale and scale > 0 and torch.isfinite(got).all().item()
    print(f"  {'ok  ' if ok else 'FAIL'} {name}: max|ref| {scale:.4g}, max err {err:.3g} "
          f"(allowed {atol + rtol * scale:.3g}), mean rel err {mean_rel:.3g}")
    return ok


@torch.no_grad()
def perturb(model, std, seed):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)


def make_inputs(model, seed):
    cfg = model.config
    size = getattr(cfg, "input_size", None) or cfg.image_size
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(4, cfg.in_channels, size, size, generator=g) * 2 - 1
    t = torch.tensor([0.02, 0.3, 0.77, 0.999], dtype=torch.float32)
    y = torch.tensor([0, 5, cfg.num_classes - 1, cfg.num_classes], dtype=torch.int64)  # last: null class
    return {"x": x.contiguous(), "t": t, "y": y}


def forward_torch(model, inputs, device):
    model = model.to(device).eval()
    with torch.no_grad():
        out = model(inputs["x"].to(device), inputs["t"].to(device), inputs["y"].to(device))
    model.to("cpu")
    return out.float().cpu()


def check_keys(preset, torch_sd, flame_sd):
    ok = True
    tk, fk = list(torch_sd.keys()), list(flame_sd.keys())
    if set(tk) != set(fk):
        print(f"  FAIL keys: only in torch {sorted(set(tk) - set(fk))[:8]}, only in FLAME {sorted(set(fk) - set(tk))[:8]}")
        return False
    # (load_file may hand keys back sorted, so the order is checked on FLAME's own listing instead.)
    for k in tk:
        if tuple(torch_sd[k].shape) != tuple(flame_sd[k].shape) or torch_sd[k].dtype != flame_sd[k].dtype:
            print(f"  FAIL {k}: torch {tuple(torch_sd[k].shape)} {torch_sd[k].dtype}, "
                  f"FLAME {tuple(flame_sd[k].shape)} {flame_sd[k].dtype}")
            ok = False
    if ok:
        print(f"  ok   keys: {len(tk)} tensors, names, shapes and dtypes identical")
    return ok


def check_key_order(binary, preset, torch_sd):
    listed = [line.split(" ")[0] for line in run_bin(binary, "keys", "--model", preset).splitlines() if line]
    if listed != list(torch_sd.keys()):
        first = next((i for i, (a, b) in enumerate(zip(listed, torch_sd.keys())) if a != b), None)
        print(f"  FAIL key order differs (first at index {first})")
        return False
    print("  ok   state-dict key order identical")
    return True


def check_init(preset, torch_sd, flame_sd):
    """Same init scheme: the same tensors are zero, pos_embed is the same table, and random
    tensors have the same spread."""
    ok = True
    for k, tt in torch_sd.items():
        ft = flame_sd[k].float()
        tt = tt.float()
        t_zero, f_zero = bool((tt == 0).all()), bool((ft == 0).all())
        if t_zero != f_zero:
            print(f"  FAIL init {k}: zero in {'torch' if t_zero else 'FLAME'} only")
            ok = False
            continue
        if k == "pos_embed":
            err = (tt - ft).abs().max().item()
            if err > 1e-6:
                print(f"  FAIL init pos_embed: sin-cos tables differ by {err:.3g}")
                ok = False
            continue
        if t_zero or tt.numel() < 1000:
            continue
        const = bool((tt == tt.flatten()[0]).all())  # GroupNorm weights (ones)
        if const:
            if not torch.equal(tt, ft):
                print(f"  FAIL init {k}: constant {tt.flatten()[0].item()} in torch, not in FLAME")
                ok = False
            continue
        ts, fs = tt.std().item(), ft.std().item()
        if not (0.85 < fs / ts < 1.15) or abs(ft.mean().item() - tt.mean().item()) > 0.1 * ts + 1e-3:
            print(f"  FAIL init {k}: std torch {ts:.4g} FLAME {fs:.4g}, mean torch {tt.mean().item():.3g} "
                  f"FLAME {ft.mean().item():.3g}")
            ok = False
    if ok:
        print("  ok   init scheme (zero tensors, pos_embed table, per-tensor spread) matches")
    return ok


def check_preset(binary, preset, device, tmp, rtol, atol):
    print(f"{preset} on {device}:")
    ok = True
    torch.manual_seed(1234)
    model = make_model(preset)
    init_sd = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = make_inputs(model, 7)
    in_path = os.path.join(tmp, f"{preset}-inputs.safetensors")
    save_file(inputs, in_path)

    # FLAME's fresh init against the twin's.
    flame_init = os.path.join(tmp, f"{preset}-flame-init.safetensors")
    run_bin(binary, "init", "--model", preset, "--seed", "3", "--out", flame_init)
    flame_init_sd = load_file(flame_init)
    ok &= check_keys(preset, init_sd, flame_init_sd)
    ok &= check_key_order(binary, preset, init_sd)
    if not ok:
        return False
    ok &= check_init(preset, init_sd, flame_init_sd)

    # torch -> FLAME.
    perturb(model, 0.02, 99)
    w_torch = os.path.join(tmp, f"{preset}-torch.safetensors")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, w_torch)
    ref = forward_torch(model, inputs, device)
    out_path = os.path.join(tmp, f"{preset}-out-a.safetensors")
    run_bin(binary, "forward", "--model", preset, "--weights", w_torch, "--inputs", in_path, "--out", out_path,
            "--device", device)
    ok &= compare("torch weights: FLAME forward vs torch", load_file(out_path)["out"], ref, rtol, atol)

    # FLAME -> torch.
    w_flame = os.path.join(tmp, f"{preset}-flame.safetensors")
    run_bin(binary, "init", "--model", preset, "--seed", "5", "--perturb", "0.02", "--out", w_flame)
    twin = make_model(preset)
    twin.load_state_dict(load_file(w_flame), strict=True)
    ref_b = forward_torch(twin, inputs, device)
    out_b = os.path.join(tmp, f"{preset}-out-b.safetensors")
    run_bin(binary, "forward", "--model", preset, "--weights", w_flame, "--inputs", in_path, "--out", out_b,
            "--device", device)
    ok &= compare("FLAME weights: torch forward vs FLAME", load_file(out_b)["out"], ref_b, rtol, atol)
    return ok


def fixed_batch_loss(model, device, seed=11, n=256):
    """Flow loss of `model` on a fixed batch of real images (same noise and t for every model)."""
    from train import find, read_idx  # noqa: E402  (numpy only needed here)
    g = torch.Generator().manual_seed(seed)
    images = torch.from_numpy(read_idx(find(None, "t10k-images-idx3-ubyte"))[:n].copy())
    x0 = (images.float() / 127.5 - 1).unsqueeze(1)
    y = torch.from_numpy(read_idx(find(None, "t10k-labels-idx1-ubyte"))[:n].astype("int64"))
    eps = torch.randn(x0.shape, generator=g)
    t = torch.sigmoid(torch.randn(n, generator=g))
    tt = t.view(-1, 1, 1, 1)
    model = model.to(device).eval()
    with torch.no_grad():
        v = model(((1 - tt) * x0 + tt * eps).to(device), t.to(device), y.to(device)).float().cpu()
    model.to("cpu")
    return torch.mean((v - (eps - x0)) ** 2).item()


def check_trained(binary, app, preset, device, tmp, rtol, atol, steps):
    """Checkpoints trained on one side load in the other and give the same outputs."""
    print(f"{preset} trained, on {device}:")
    ok = True
    torch.manual_seed(4321)
    fresh_loss = fixed_batch_loss(make_model(preset), device)
    inputs = make_inputs(make_model(preset), 8)
    in_path = os.path.join(tmp, f"{preset}-trained-inputs.safetensors")
    save_file(inputs, in_path)

    # PyTorch trains -> FLAME loads (diffusion_interop forward, flame-diffusion sample).
    w_torch = os.path.join(tmp, f"{preset}-torch-trained.safetensors")
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, os.path.join(here, "train.py"), "--model", preset, "--steps", str(steps),
                        "--device", device, "--out", w_torch], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"  FAIL torch training: {r.stdout}{r.stderr}")
        return False
    twin = make_model(preset)
    twin.load_state_dict(load_file(w_torch), strict=True)
    loss_t = fixed_batch_loss(twin, device)
    trained = loss_t < 0.8 * fresh_loss
    print(f"  {'ok  ' if trained else 'FAIL'} torch-trained: fixed-batch loss {loss_t:.4f} (fresh model {fresh_loss:.4f})")
    ok &= trained
    ref = forward_torch(twin, inputs, device)
    out = os.path.join(tmp, f"{preset}-trained-out-a.safetensors")
    run_bin(binary, "forward", "--model", preset, "--weights", w_torch, "--inputs", in_path, "--out", out,
            "--device", device)
    ok &= compare("torch-trained weights: FLAME forward vs torch", load_file(out)["out"], ref, rtol, atol)
    grid = os.path.join(tmp, f"{preset}-torch-trained-grid.png")
    run_bin(app, "sample", "--checkpoint", w_torch, "--n", "2", "--sample-steps", "8", "--device", device, "--out", grid)
    has_grid = os.path.isfile(grid) and os.path.getsize(grid) > 100
    print(f"  {'ok  ' if has_grid else 'FAIL'} flame-diffusion sample on the torch-trained weights wrote {grid}")
    ok &= has_grid

    # FLAME trains -> flame-diffusion export -> PyTorch loads strictly.
    run_dir = os.path.join(tmp, f"{preset}-flame-run")
    run_bin(app, "train", "--model", preset, "--steps", str(steps), "--batch", "128", "--lr", "1e-3",
            "--sample-every", "0", "--ckpt-every", "0", "--no-progress", "--device", device, "--out", run_dir)
    ckpts = sorted(f for f in os.listdir(os.path.join(run_dir, "checkpoints")) if f.endswith(".safetensors"))
    w_flame = os.path.join(tmp, f"{preset}-flame-trained.safetensors")
    run_bin(app, "export", "--checkpoint", os.path.join(run_dir, "checkpoints", ckpts[-1]), "--out", w_flame)
    twin_b = make_model(preset)
    twin_b.load_state_dict(load_file(w_flame), strict=True)
    loss_f = fixed_batch_loss(twin_b, device)
    trained = loss_f < 0.8 * fresh_loss
    print(f"  {'ok  ' if trained else 'FAIL'} FLAME-trained (in torch): fixed-batch loss {loss_f:.4f} "
          f"(fresh model {fresh_loss:.4f})")
    ok &= trained
    ref_b = forward_torch(twin_b, inputs, device)
    out_b = os.path.join(tmp, f"{preset}-trained-out-b.safetensors")
    run_bin(binary, "forward", "--model", preset, "--weights", w_flame, "--inputs", in_path, "--out", out_b,
            "--device", device)
    ok &= compare("FLAME-trained weights: torch forward vs FLAME", load_file(out_b)["out"], ref_b, rtol, atol)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="build/apps/diffusion/diffusion_interop", help="the diffusion_interop program")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--models", default=DEFAULT_MODELS, help=f"comma-separated presets (default {DEFAULT_MODELS})")
    ap.add_argument("--rtol", type=float, default=None,
                    help="relative to max|ref| (default 2e-4 on cpu, 5e-3 on cuda: FLAME's f32 convs may use TF32)")
    ap.add_argument("--atol", type=float, default=1e-5)
    ap.add_argument("--keep", default=None, help="directory to keep the files in (default: a temporary one)")
    ap.add_argument("--trained", action="store_true",
                    help="also train each preset on both sides (train.py, flame-diffusion train) and check "
                         "that the trained weights load in the other and give the same outputs")
    ap.add_argument("--app", default=None, help="the flame-diffusion program (default: beside --bin)")
    ap.add_argument("--train-steps", type=int, default=300)
    args = ap.parse_args()

    if not os.path.isfile(args.bin) or not os.access(args.bin, os.X_OK):
        print(f"interop.py: error: --bin {args.bin} is not an executable (build the diffusion_interop target)")
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("interop.py: error: --device cuda but torch sees no CUDA device")
        return 2
    # The twin is the fp32 reference: no TF32 on its side.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rtol = args.rtol if args.rtol is not None else (2e-4 if args.device == "cpu" else 5e-3)

    results = {}
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = args.keep or tmpdir
        os.makedirs(tmp, exist_ok=True)
        for preset in [m.strip() for m in args.models.split(",") if m.strip()]:
            try:
                results[preset] = check_preset(args.bin, preset, args.device, tmp, rtol, args.atol)
                if args.trained:
                    app = args.app or os.path.join(os.path.dirname(args.bin), "flame-diffusion")
                    results[preset + " trained"] = check_trained(args.bin, app, preset, args.device, tmp, rtol,
                                                                 args.atol, args.train_steps)
            except Exception as e:  # a failed run or load is a failed check, with its message
                print(f"  FAIL {preset}: {type(e).__name__}: {e}")
                results[preset] = False
    failed = [p for p, ok in results.items() if not ok]
    print(f"interop: {len(results) - len(failed)} passed, {len(failed)} failed" +
          (f" ({', '.join(failed)})" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
