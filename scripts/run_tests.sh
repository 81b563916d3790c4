#!/usr/bin/env bash
# Installs dependencies, builds, and runs the whole test suite with ctest.
# FLAME_TEST_DEVICE=cuda runs it on GPU 0 (CUDA cases skip with a message when there is no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh "$@"
cd "${BUILD_DIR:-build}"
ctest --output-on-failure -j "${JOBS:-$(nproc)}"
