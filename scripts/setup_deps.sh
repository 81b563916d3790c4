#!/usr/bin/env bash
# Installs what building FLAME needs on a Debian machine, only where it is missing:
# a C++20 compiler, CMake, Ninja, OpenBLAS (CPU GEMM) and GoogleTest; for the diffusion trainer
# (apps/diffusion) libpng, zlib, CLI11, libjpeg, libwebp, toml++, utf8proc, RE2, SentencePiece and the Fashion-MNIST data
# set. The CUDA toolkit is used when present (nvcc on PATH or in /usr/local/cuda) and is never installed here.
set -euo pipefail

need=()
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v ninja >/dev/null 2>&1 || need+=(ninja-build)
command -v g++ >/dev/null 2>&1 || need+=(g++)
[ -f /usr/include/x86_64-linux-gnu/openblas-pthread/cblas.h ] || [ -f /usr/include/openblas/cblas.h ] ||
  ls /usr/include/*/openblas*/cblas.h >/dev/null 2>&1 || need+=(libopenblas-dev)
[ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
[ -f /usr/include/nlohmann/json.hpp ] || need+=(nlohmann-json3-dev)
# apps/diffusion: PNG writing, gunzip of the IDX files, the CLI, and the data set itself (gzip'd
# IDX files in /usr/share/datasets/fashion-mnist; apps/diffusion/README.md, "Data").
[ -f /usr/include/png.h ] || need+=(libpng-dev)
[ -f /usr/include/zlib.h ] || need+=(zlib1g-dev)
[ -f /usr/include/CLI/CLI.hpp ] || need+=(libcli11-dev)
[ -f /usr/include/jpeglib.h ] || need+=(libjpeg-dev)  # libjpeg-turbo: sample --out *.jpg
# Fine-tuning data and configuration: WebP training images, the TOML configuration (header-only toml++).
[ -f /usr/include/webp/decode.h ] || need+=(libwebp-dev)
[ -f /usr/include/toml++/toml.h ] || need+=(libtomlplusplus-dev)
# Text tokenizers (apps/diffusion/models/tokenizer_*): Unicode data, CLIP's regex, T5's SentencePiece.
[ -f /usr/include/utf8proc.h ] || need+=(libutf8proc-dev)
[ -f /usr/include/re2/re2.h ] || need+=(libre2-dev)
[ -f /usr/include/sentencepiece_processor.h ] || need+=(libsentencepiece-dev)
[ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] || need+=(dataset-fashion-mnist)

if [ ${#need[@]} -gt 0 ]; then
  echo "setup_deps: installing ${need[*]}" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# CUDA sources are C++20: CMake knows nvcc's C++20 flag from 3.26 on. An older CMake gets a newer
# one from PyPI, in a folder of its own (nothing system-wide changes).
cmake_ok() {
  local v
  v=$(cmake --version 2>/dev/null | head -1 | awk '{print $3}')
  [ -n "$v" ] && [ "$(printf '%s\n' 3.26 "$v" | sort -V | head -1)" = 3.26 ]
}
CMAKE_DIR="${FLAME_TOOLS_DIR:-$HOME/.cache/flame-tools}/cmake"
if ! cmake_ok && { command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; }; then
  if [ ! -x "$CMAKE_DIR/bin/cmake" ]; then
    echo "setup_deps: installing CMake >= 3.26 from PyPI into $CMAKE_DIR" >&2
    python3 -m pip install --quiet --disable-pip-version-check --target "$CMAKE_DIR/py" 'cmake>=3.26' >&2
    mkdir -p "$CMAKE_DIR/bin"
    ln -sf "$CMAKE_DIR"/py/cmake/data/bin/* "$CMAKE_DIR/bin/"
  fi
  echo "export PATH=$CMAKE_DIR/bin:\$PATH"
fi

# cuDNN's header-only C++ frontend (PyPI nvidia-cudnn-frontend) for the CUDA convolution and
# attention paths: only its include/ folder is kept, in the repository's ignored .deps/ folder
# (CMake looks there; the GPU runner carries .deps/).
CFE_VERSION=1.32.0
CFE_DIR="$(cd "$(dirname "$0")/.." && pwd)/.deps/cudnn_frontend"
if { command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; } &&
   [ ! -f "$CFE_DIR/include/cudnn_frontend.h" ]; then
  echo "setup_deps: fetching nvidia-cudnn-frontend $CFE_VERSION headers into $CFE_DIR" >&2
  tmp=$(mktemp -d)
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.11 --implementation cp --platform manylinux_2_28_x86_64 \
    -d "$tmp" "nvidia-cudnn-frontend==$CFE_VERSION" >&2
  mkdir -p "$CFE_DIR"
  python3 -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("include/")])' \
    "$tmp"/nvidia_cudnn_frontend-*.whl "$CFE_DIR"
  rm -rf "$tmp"
fi

# nvcc is often installed but not on PATH.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "export PATH=/usr/local/cuda/bin:\$PATH"
fi
