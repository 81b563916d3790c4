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
  # No --model on the CPU: flame-diffusion's CPU recipe (CpuRecipe in apps/diffusion/src/trainer.h:
  # unet-tiny, batch 32, lr 2e-3 cosine after 50 warmup steps, EMA 0.995, 1200 steps or 510 s,
  # Euler 16 steps at CFG 3), the one place its values live.
  exec "$BIN" train --device cpu --ckpt-every 400 --out runs/demo-cpu "$@"
fi
