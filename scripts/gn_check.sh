#!/usr/bin/env bash
# GroupNorm CUDA check (run from the repository root on the GPU machine; $1 = a build directory
# with flame_tests and bench_nn_norm built with CUDA): the normalisation benchmark next to
# PyTorch's, then the CUDA normalisation tests against the CPU reference. Under 90 s on an H100.
set -u
B=${1:?usage: scripts/gn_check.sh BUILD_DIR}
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null
echo "== bench_nn_norm vs PyTorch"
BF=$(mktemp) BT=$(mktemp)
timeout 30 "$B/bench/bench_nn_norm" --reps 30 >"$BF" 2>&1
timeout 40 python3 bench/bench_nn_norm_torch.py --reps 30 >"$BT" 2>&1
python3 bench/compare.py "$BF" "$BT" 2>&1 | grep -E "norm|copy" || true
rm -f "$BF" "$BT"
FILTER='NormCuda.GroupNorm*'
echo "== tests: $FILTER"
FLAME_TEST_DEVICE=cuda timeout 40 "$B/tests/flame_tests" --gtest_filter="$FILTER" --gtest_brief=1 2>&1 |
  grep -vE "^\[ +(RUN|OK) |: Skipped$|CUDA case skipped" | tail -12
