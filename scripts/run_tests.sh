#!/usr/bin/env bash
# Installs dependencies, builds, and runs the whole test suite with ctest.
# FLAME_TEST_DEVICE=cuda runs it on GPU 0 and fails when no GPU is found (docs/testing.md); in a
# CPU run the CUDA-only cases skip, each with a message.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh "$@"
cd "${BUILD_DIR:-build}"
ctest --output-on-failure -j "${JOBS:-$(nproc)}"
