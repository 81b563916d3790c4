#!/usr/bin/env bash
# Fills the ignored .deps/ folder with what a build on a machine without apt or internet needs
# (the GPU machine): GoogleTest sources, nlohmann-json headers, cudnn-frontend headers. Run it
# here, then carry ".deps" with the GPU runner (scripts/gpu_run.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(bash scripts/setup_deps.sh)"
mkdir -p .deps
[ -f .deps/googletest/CMakeLists.txt ] || cp -r /usr/src/googletest .deps/
if [ ! -f .deps/nlohmann_json/include/nlohmann/json.hpp ]; then
  mkdir -p .deps/nlohmann_json/include && cp -r /usr/include/nlohmann .deps/nlohmann_json/include/
fi
[ -f .deps/cudnn_frontend/include/cudnn_frontend.h ] || { echo "prepare_carry: cudnn-frontend missing (setup_deps needs nvcc)" >&2; exit 1; }
du -sh .deps
