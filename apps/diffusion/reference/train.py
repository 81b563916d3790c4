#!/usr/bin/env python3
"""PyTorch twin of `flame-diffusion train` (flow objective), for checkpoints trained on this side.

Trains a preset of dit.py / unet.py on Fashion-MNIST with the recipe of apps/diffusion/src/
trainer.cpp: rectified flow with logit-normal t, 10% label dropout to the null class, AdamW
(weight decay 0), gradient clipping at 1.0, EMA with warm-up (decay min(d, (1+k)/(10+k))), bf16
autocast on CUDA, random horizontal flips, pixels in [-1, 1]. Writes the EMA weights as a plain
safetensors state dict with {"format": "pt", "model": PRESET, "objective": "flow"} metadata:
`flame-diffusion sample --checkpoint W` and `finetune --base W` load it, and interop.py --trained
checks that FLAME's forward reproduces this model's.

  python3 apps/diffusion/reference/train.py --model dit-tiny --steps 300 --out w.safetensors
"""
import argparse
import copy
import gzip
import os
import sys
import time

import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import drop_labels  # noqa: E402
from diffusion import flow_loss  # noqa: E402
from unet import make_model  # noqa: E402

DATA_DIRS = ["/usr/share/datasets/fashion-mnist", ".deps/fashion_mnist"]  # as src/data.cpp


def read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    magic = int.from_bytes(data[0:4], "big")
    if magic >> 8 != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file (magic {magic:#x})")
    ndim = magic & 0xFF
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    arr = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if arr.size != int(np.prod(dims)):
        raise ValueError(f"{path}: {arr.size} values for dims {dims}")
    return arr.reshape(dims)


def find(data_dir, stem):
    env = os.environ.get("FLAME_FASHION_MNIST")
    dirs = [data_dir] if data_dir else ([env] if env else DATA_DIRS)
    for d in dirs:
        for name in (stem, stem + ".gz"):
            p = os.path.join(d, name)
            if os.path.isfile(p):
                return p
    raise FileNotFoundError(f"{stem}[.gz] not found in {dirs} (pass --data DIR)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dit-tiny")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--label-dropout", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--data", default=None, help="folder with train-images-idx3-ubyte[.gz] and labels")
    ap.add_argument("--out", required=True, help="safetensors path of the EMA weights")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    images = torch.from_numpy(read_idx(find(args.data, "train-images-idx3-ubyte")).copy())
    labels = torch.from_numpy(read_idx(find(args.data, "train-labels-idx1-ubyte")).astype(np.int64))
    images = (images.float() / 127.5 - 1.0).unsqueeze(1).to(dev)  # [N, 1, 28, 28] in [-1, 1]
    labels = labels.to(dev)

    model = make_model(args.model).to(dev)
    ema = copy.deepcopy(model).eval()
    for p in ema.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    num_classes = model.config.num_classes
    amp = dev.type == "cuda"
    g = torch.Generator(device=dev).manual_seed(args.seed)
    start, loss_sum = time.time(), 0.0
    for step in range(args.steps):
        idx = torch.randint(0, images.shape[0], (args.batch,), device=dev, generator=g)
        x0, y = images[idx], labels[idx]
        flip = torch.rand(args.batch, device=dev, generator=g) < 0.5
        x0 = torch.where(flip.view(-1, 1, 1, 1), x0.flip(-1), x0)
        y = drop_labels(y, args.label_dropout, num_classes, generator=g)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            loss = flow_loss(model, x0, y, generator=g)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        decay = min(args.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for pe, p in zip(ema.parameters(), model.parameters()):
                pe.lerp_(p, 1 - decay)
        loss_sum += loss.item()
        if (step + 1) % max(1, args.steps // 5) == 0:
            print(f"step {step + 1}/{args.steps}  loss {loss_sum / max(1, args.steps // 5):.4f}  "
                  f"{time.time() - start:.1f} s", flush=True)
            loss_sum = 0.0
    sd = {k: v.detach().float().contiguous().cpu() for k, v in ema.state_dict().items()}
    save_file(sd, args.out, metadata={"format": "pt", "model": args.model, "objective": "flow"})
    print(f"{args.model}: EMA weights after {args.steps} steps -> {args.out}")


if __name__ == "__main__":
    main()
