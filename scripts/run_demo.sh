#!/usr/bin/env bash
# The main job: installs dependencies (apt-get, including the Fashion-MNIST package), builds, and
# trains a class-conditional diffusion model on Fashion-MNIST with apps/diffusion (flame-diffusion).
#   on a GPU: dit-s, rectified flow, batch 256, bf16 autocast, about 5 minutes
#   on the CPU: dit-tiny, batch 32, 300 steps (about 10 minutes on 2 cores after the build; a blurrier grid)
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
  exec "$BIN" train --model dit-tiny --objective flow --batch 32 --steps 300 --lr 1e-3 --sample-every 100 \
    --ckpt-every 100 --sample-steps 16 --device cpu --out runs/demo-cpu "$@"
fi
