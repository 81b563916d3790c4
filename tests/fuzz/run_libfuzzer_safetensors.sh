#!/usr/bin/env bash
# Long libFuzzer run of the safetensors header parser under ASan + UBSan (docs/safetensors.md).
#   tests/fuzz/run_libfuzzer_safetensors.sh [SECONDS] [WORK_DIR]
# Needs clang with libFuzzer (Debian: clang). Builds the format unit alone, seeds the corpus
# with valid files from the seeded driver, and runs libFuzzer for SECONDS (default 600).
set -euo pipefail
SECONDS_BUDGET=${1:-600}
WORK=${2:-build-fuzz-safetensors}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
CXX=${CXX_FUZZ:-clang++}
JSON_INC=$(dirname "$(find "$ROOT/.deps/nlohmann_json/include" /usr/include -path '*nlohmann/json.hpp' 2>/dev/null | head -1)")/..
mkdir -p "$WORK/corpus"
SRC=("$ROOT/tests/fuzz/fuzz_safetensors.cpp" "$ROOT/src/io/safetensors_format.cpp")
INC=(-I"$ROOT" -I"$ROOT/include" -I"$JSON_INC")
"$CXX" -std=c++20 -O1 -g "${INC[@]}" "${SRC[@]}" -o "$WORK/seeded"
"$WORK/seeded" --seed 1 --write-corpus "$WORK/corpus"
"$CXX" -std=c++20 -O1 -g -DFLAME_LIBFUZZER=1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
  "${INC[@]}" "${SRC[@]}" -o "$WORK/libfuzzer"
"$WORK/libfuzzer" -max_total_time="$SECONDS_BUDGET" -max_len=4096 -print_final_stats=1 "$WORK/corpus"
