#!/usr/bin/env bash
# Long libFuzzer run of the IDX reader under ASan + UBSan (apps/diffusion/README.md, "Data").
#   apps/diffusion/tests/fuzz/run_libfuzzer_idx.sh [SECONDS] [WORK_DIR]
# Needs clang with libFuzzer (Debian: clang) and zlib1g-dev. Builds src/data/idx.cpp alone, seeds the corpus
# with valid files (plain and gzip'd) from the seeded driver, and runs libFuzzer for SECONDS
# (default 600).
set -euo pipefail
SECONDS_BUDGET=${1:-600}
WORK=${2:-build-fuzz-idx}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../../.." && pwd)
SRC_DIR=$ROOT/src/data
INC_DIR=$ROOT/include
CXX=${CXX_FUZZ:-clang++}
mkdir -p "$WORK/corpus"
SRC=("$HERE/fuzz_idx.cpp" "$SRC_DIR/idx.cpp")
"$CXX" -std=c++20 -O1 -g -I"$INC_DIR" "${SRC[@]}" -lz -o "$WORK/seeded"
"$WORK/seeded" --seed 1 --write-corpus "$WORK/corpus"
"$CXX" -std=c++20 -O1 -g -DFLAME_LIBFUZZER=1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
  -I"$INC_DIR" "${SRC[@]}" -lz -o "$WORK/libfuzzer"
"$WORK/libfuzzer" -max_total_time="$SECONDS_BUDGET" -max_len=4096 -print_final_stats=1 "$WORK/corpus"
