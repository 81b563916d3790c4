#!/usr/bin/env bash
# Configures and builds FLAME into $BUILD_DIR (default build/); extra arguments go to CMake.
# CUDA is enabled when nvcc is found. $TARGETS limits what is built (default: everything).
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(bash scripts/setup_deps.sh)"
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
# Note [GPU-less builds]: on a machine where nvidia-smi sees no GPU the CUDA kernels are compiled
# but can never run, so their device code is built as PTX only (FLAME_CUDA_ARCHS=90-virtual): the
# CUDA sources still go through nvcc's front end and NVVM, and ptxas, a third of their compile time,
# is left to the machines that run them (a GPU machine here, and scripts/gpu_run.sh, build sm_90
# code; a driver would also JIT the PTX). An explicit -DFLAME_CUDA_ARCHS=... argument wins.
arch=90
if ! nvidia-smi -L >/dev/null 2>&1; then
  arch=90-virtual
  if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
    echo "build.sh: no GPU visible, so CUDA device code is built as PTX only (FLAME_CUDA_ARCHS=90-virtual);" \
      "give -DFLAME_CUDA_ARCHS=90 for a build that will run on a GPU elsewhere" >&2
  fi
fi
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLAME_CUDA_ARCHS="$arch" "$@" >/dev/null
ninja -C "$BUILD_DIR" -j "$JOBS" ${TARGETS:-}
