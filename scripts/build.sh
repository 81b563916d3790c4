#!/usr/bin/env bash
# Configures and builds FLAME into $BUILD_DIR (default build/); extra arguments go to CMake.
# CUDA is enabled when nvcc is found. $TARGETS limits what is built (default: everything).
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(bash scripts/setup_deps.sh)"
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
ninja -C "$BUILD_DIR" -j "$JOBS" ${TARGETS:-}
