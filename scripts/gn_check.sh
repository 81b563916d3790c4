#!/usr/bin/env bash
# GroupNorm CUDA check (run from the repository root on the GPU machine; $1 = a build directory
# with flame_tests and bench_nn_norm built with CUDA). Prints the GroupNorm tests on CUDA for the
# default kernels and for every tuning variant forced through FLAME_GN_VARIANT (each checked
# against the CPU reference), then the benchmark per variant (FLAME_GN_SWEEP) next to PyTorch's.
set -u
B=${1:?usage: scripts/gn_check.sh BUILD_DIR}
T="$B/tests/flame_tests"
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null
echo "== tests, default kernels: NormCuda*:*GroupNorm*"
FLAME_TEST_DEVICE=cuda timeout 120 "$T" --gtest_filter='NormCuda*:*GroupNorm*' --gtest_brief=1 2>&1 | grep -vE "^\[ +(RUN|OK) |: Skipped$|CUDA case skipped" | tail -16
# Each forward and each backward variant at least once.
for v in f1b1 f2b2 f3b3 f4b4 f2b5; do
  echo "== tests, FLAME_GN_VARIANT=$v: NormCuda.GroupNorm*"
  FLAME_GN_VARIANT=$v FLAME_TEST_DEVICE=cuda timeout 60 "$T" --gtest_filter='NormCuda.GroupNorm*' --gtest_brief=1 2>&1 | grep -vE "^\[ +(RUN|OK) |: Skipped$|CUDA case skipped" | tail -12
done
echo "== bench (the default kernels, then every variant pair) vs PyTorch"
BF=$(mktemp) BT=$(mktemp)
timeout 60 "$B/bench/bench_nn_norm" >"$BF" 2>&1
# One process per backward variant (a variant that failed cannot poison the others' context);
# the staged forward f3 last in each.
for b in b0 b1 b4 b5 b2 b3; do
  FLAME_GN_SWEEP="f0$b,f1$b,f2$b,f4$b,f3$b" timeout 40 "$B/bench/bench_nn_norm" 2>&1 | grep -v "norm_d2d_copy" >>"$BF"
done
timeout 60 python3 bench/bench_nn_norm_torch.py >"$BT" 2>&1
python3 bench/compare.py "$BF" "$BT" 2>&1 | grep -E "group|copy" || true
echo "-- raw FLAME lines"
grep -E "group_norm|copy" "$BF" | sed 's/^BENCH //'
grep -E "group_norm" "$BT" | sed 's/^BENCH /torch /'
rm -f "$BF" "$BT"
