#!/usr/bin/env bash
# The main job: installs dependencies (apt-get, including the Fashion-MNIST package), builds, and
# trains a class-conditional diffusion model on Fashion-MNIST with apps/diffusion (flame-diffusion).
#   on a GPU: dit-s, rectified flow, batch 256, bf16 autocast, about 5 minutes
#   on the CPU: unet-tiny, batch 32, lr 2e-3 (50 warmup steps, cosine), EMA 0.995, up to 1200 steps or
#     510 s, then a 16-step Euler grid at CFG 3: about 9 minutes on 2 cores after the build (docs/cpu-backend.md;
#     the app classifier recognises ~79% of its samples as their class)
# It ends by printing where the sample grid and the loss curve are. Extra arguments go to
# `flame-diffusion train` (e.g. --steps 6000 --time-limit 0 for the full recipe).
set -euo pipefail
cd "$(dirname "$0")/.."
TARGETS=flame-diffusion bash scripts/build.sh
BIN="${BUILD_DIR:-build}/apps/diffusion/flame-diffusion"
if nvidia-smi -L >/dev/null 2>&1 && command -v nvcc >/dev/null 2>&1; then
  exec "$BIN" train --model dit-s --objective flow --batch 256 --steps 6000 --time-limit 300 \
    --sample-every 1000 --ckpt-every 1000 --device cuda --out runs/demo-dit-s "$@"
else
  exec "$BIN" train --model unet-tiny --objective flow --batch 32 --steps 1200 --time-limit 510 --lr 2e-3 \
    --warmup 50 --schedule cosine --ema 0.995 --sample-every 0 --ckpt-every 400 --sample-steps 16 --cfg 3 \
    --device cpu --out runs/demo-cpu "$@"
fi
