#!/usr/bin/env bash
# Installs dependencies, builds, and runs the whole test suite with ctest.
# FLAME_TEST_DEVICE=cuda runs it on GPU 0 and fails when no GPU is found (docs/testing.md); in a
# CPU run the CUDA-only cases skip, each with a message.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh "$@"
cd "${BUILD_DIR:-build}"
rc=0
ctest --output-on-failure -j "${JOBS:-$(nproc)}" || rc=$?
if [ "$rc" -ne 0 ]; then
  # ctest's summary names the failing entries; a shard's output is long, so the failing cases and
  # the shuffle seed (to rerun that order: --gtest_shuffle --gtest_random_seed=N) come once more, last.
  log=Testing/Temporary/LastTest.log
  if [ -f "$log" ]; then
    echo "---- failing GoogleTest cases (from $log) ----"
    grep -E "^shuffle seed|^\[  FAILED  \]|Failure$|^[^ ]+:[0-9]+: Failure" "$log" | head -40 || true
  fi
fi
exit "$rc"
