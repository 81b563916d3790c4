#!/usr/bin/env bash
# Fills the ignored .deps/ folder with what a build on a machine without apt or internet needs
# (the GPU machine): GoogleTest sources, nlohmann-json headers, cudnn-frontend headers, and for
# apps/diffusion the Fashion-MNIST files, CLI11 and toml++ headers and libpng/zlib/libjpeg/libwebp/
# utf8proc/RE2 headers with static libraries, SentencePiece with its shared library (apps/diffusion/deps.cmake
# uses those only where the machine has none of its own). Run
# it here, then carry ".deps" with the GPU runner (scripts/gpu_run.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(bash scripts/setup_deps.sh)"
mkdir -p .deps
[ -f .deps/googletest/CMakeLists.txt ] || cp -r /usr/src/googletest .deps/
if [ ! -f .deps/nlohmann_json/include/nlohmann/json.hpp ]; then
  mkdir -p .deps/nlohmann_json/include && cp -r /usr/include/nlohmann .deps/nlohmann_json/include/
fi
# apps/diffusion. The data set (about 30 MB of gzip'd IDX files) is found in .deps/fashion_mnist
# by the trainer's data-dir lookup (apps/diffusion/README.md, "Data").
mkdir -p .deps/fashion_mnist
for f in train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz; do
  [ -f ".deps/fashion_mnist/$f" ] || cp "/usr/share/datasets/fashion-mnist/$f" .deps/fashion_mnist/
done
if [ ! -f .deps/cli11/include/CLI/CLI.hpp ]; then
  mkdir -p .deps/cli11/include && cp -r /usr/include/CLI .deps/cli11/include/
fi
# Static libraries: nothing to find at run time, and no symlinks to carry.
if [ ! -f .deps/png/lib/libpng16.a ]; then
  mkdir -p .deps/png/include .deps/png/lib
  cp -L /usr/include/png.h /usr/include/pngconf.h /usr/include/pnglibconf.h /usr/include/zlib.h \
    /usr/include/zconf.h .deps/png/include/
  cp -L /usr/lib/x86_64-linux-gnu/libpng16.a /usr/lib/x86_64-linux-gnu/libz.a .deps/png/lib/
fi
# libjpeg-turbo (sample --out *.jpg): headers and the static library.
if [ ! -f .deps/jpeg/lib/libjpeg.a ] && [ -f /usr/lib/x86_64-linux-gnu/libjpeg.a ]; then
  mkdir -p .deps/jpeg/include .deps/jpeg/lib
  cp -L /usr/include/jpeglib.h /usr/include/jerror.h /usr/include/jmorecfg.h \
    /usr/include/x86_64-linux-gnu/jconfig.h .deps/jpeg/include/
  cp -L /usr/lib/x86_64-linux-gnu/libjpeg.a .deps/jpeg/lib/
fi
# libwebp (WebP training images): headers and the static library (Debian's libwebp.a has no
# further dependencies), like libjpeg; toml++ (the fine-tuning configuration) is header-only.
if [ ! -f .deps/webp/lib/libwebp.a ] && [ -f /usr/lib/x86_64-linux-gnu/libwebp.a ]; then
  mkdir -p .deps/webp/include .deps/webp/lib
  cp -rL /usr/include/webp .deps/webp/include/
  cp -L /usr/lib/x86_64-linux-gnu/libwebp.a .deps/webp/lib/
fi
if [ ! -f .deps/tomlplusplus/include/toml++/toml.h ]; then
  mkdir -p .deps/tomlplusplus/include && cp -rL /usr/include/toml++ .deps/tomlplusplus/include/
fi
# Text tokenizers: utf8proc and RE2 as static libraries; SentencePiece has no static library in
# Debian, so its shared one is carried (it needs only libstdc++; protobuf-lite is built in).
if [ ! -f .deps/text/lib/libre2.a ]; then
  mkdir -p .deps/text/include .deps/text/lib
  cp -L /usr/include/utf8proc.h .deps/text/include/
  cp -rL /usr/include/re2 .deps/text/include/
  cp -L /usr/lib/x86_64-linux-gnu/libutf8proc.a /usr/lib/x86_64-linux-gnu/libre2.a .deps/text/lib/
fi
if [ ! -f .deps/sentencepiece/lib/libsentencepiece.so ]; then
  mkdir -p .deps/sentencepiece/include .deps/sentencepiece/lib
  cp -L /usr/include/sentencepiece_processor.h .deps/sentencepiece/include/
  # Two plain copies, no symlink: the linker looks for the .so, the loader for the soname.
  cp -L /usr/lib/x86_64-linux-gnu/libsentencepiece.so.0 .deps/sentencepiece/lib/
  cp -L /usr/lib/x86_64-linux-gnu/libsentencepiece.so.0 .deps/sentencepiece/lib/libsentencepiece.so
fi
[ -f .deps/cudnn_frontend/include/cudnn_frontend.h ] || { echo "prepare_carry: cudnn-frontend missing (setup_deps needs nvcc)" >&2; exit 1; }
du -sh .deps
