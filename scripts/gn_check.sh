#!/usr/bin/env bash
# GroupNorm CUDA check (run from the repository root on the GPU machine; $1 = a build directory
# with flame_tests and bench_nn_norm built with CUDA). First the benchmark: the default kernels,
# then every tuning variant pair (FLAME_GN_SWEEP), next to PyTorch's; then the GroupNorm tests on
# CUDA for the default kernels and for the tuning variants forced through FLAME_GN_VARIANT (each
# checked against the CPU reference). Under 90 s on an H100.
set -u
B=${1:?usage: scripts/gn_check.sh BUILD_DIR}
T="$B/tests/flame_tests"
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null
echo "== bench (the default kernels, then every variant pair) vs PyTorch"
BF=$(mktemp) BT=$(mktemp)
timeout 30 "$B/bench/bench_nn_norm" --reps 30 >"$BF" 2>&1
# One process per backward variant (a variant that failed cannot poison the others' context);
# the staged forward f3 last in each.
for b in b0 b1 b5 b4 b3 b2; do
  FLAME_GN_SWEEP="f0$b,f1$b,f2$b,f4$b,f3$b" timeout 15 "$B/bench/bench_nn_norm" --reps 30 2>&1 |
    grep -v "norm_d2d_copy" >>"$BF"
done
timeout 40 python3 bench/bench_nn_norm_torch.py --reps 30 >"$BT" 2>&1
python3 bench/compare.py "$BF" "$BT" 2>&1 | grep -E "group|copy" || true
echo "-- raw lines"
grep -E "group_norm|copy" "$BF" | sed 's/^BENCH //'
grep -E "group_norm|copy" "$BT" | sed 's/^BENCH /torch /'
rm -f "$BF" "$BT"
FILTER='NormCuda.GroupNorm*'
echo "== tests, default kernels: $FILTER"
FLAME_TEST_DEVICE=cuda timeout 25 "$T" --gtest_filter="$FILTER" --gtest_brief=1 2>&1 |
  grep -vE "^\[ +(RUN|OK) |: Skipped$|CUDA case skipped" | tail -12
for v in f4b4 f3b1; do
  echo "== tests, FLAME_GN_VARIANT=$v: $FILTER"
  FLAME_GN_VARIANT=$v FLAME_TEST_DEVICE=cuda timeout 20 "$T" --gtest_filter="$FILTER" --gtest_brief=1 2>&1 |
    grep -vE "^\[ +(RUN|OK) |: Skipped$|CUDA case skipped" | tail -8
done
