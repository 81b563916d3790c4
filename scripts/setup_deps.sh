#!/usr/bin/env bash
# Installs what building FLAME needs on a Debian machine, only where it is missing:
# a C++20 compiler, CMake, Ninja, OpenBLAS (CPU GEMM) and GoogleTest. The CUDA toolkit is used
# when present (nvcc on PATH or in /usr/local/cuda) and is never installed here.
set -euo pipefail

need=()
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v ninja >/dev/null 2>&1 || need+=(ninja-build)
command -v g++ >/dev/null 2>&1 || need+=(g++)
[ -f /usr/include/x86_64-linux-gnu/openblas-pthread/cblas.h ] || [ -f /usr/include/openblas/cblas.h ] ||
  ls /usr/include/*/openblas*/cblas.h >/dev/null 2>&1 || need+=(libopenblas-dev)
[ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)

if [ ${#need[@]} -gt 0 ]; then
  echo "setup_deps: installing ${need[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# nvcc is often installed but not on PATH.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "export PATH=/usr/local/cuda/bin:\$PATH"
fi
