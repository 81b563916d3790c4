#!/usr/bin/env bash
# Installs dependencies, builds, and runs the main job: the MLP regression demo, on the GPU when
# one is available, else on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGETS=mlp_regression bash scripts/build.sh
"${BUILD_DIR:-build}/examples/mlp_regression" "$@"
