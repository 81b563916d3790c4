#!/usr/bin/env bash
# Builds, tests and benchmarks FLAME on a GPU machine in one call, and prints a short summary
# LAST. Run it from the repository root (docs/gpu-runner.md):
#
#   scripts/gpu_run.sh [--sanitize] [--no-tests] [--no-bench] [--no-example] [--tests GTEST_FILTER]
#                      [--allow-skip REGEX] [--sanitize-filter GTEST_FILTER] [--racecheck-filter GTEST_FILTER]
#                      [--jobs N] [--gtest-shards N] [--shuffle-rounds N] [--shuffle-seed S]
#                      [--budget SECONDS] [--build-dir DIR] [--suite] [--suite-budget SECONDS]
#
# Steps: configure + build (Release, sm_90, ninja on all cores); the whole test suite on CUDA
# (FLAME_TEST_DEVICE=cuda ctest -j N over the shards CMake registers; or, with --gtest-shards N,
# the test binary itself in N parallel shards), failing when fewer cases ran than listed or a
# case skipped outside the allow-list (Note [Counting CUDA cases]); with --shuffle-rounds N, N more
# runs of the whole binary in shuffled order, each with its own seed and shard count (Note [Shuffled
# rounds]); with
# --sanitize, compute-sanitizer memcheck on a subset (and racecheck on another with
# --racecheck-filter); the custom_kernel example twice (the second run must load from the kernel
# disk cache); the benchmarks (bench_ops, bench/bench_torch.py, bench/compare.py; with --suite instead
# bench/suite.py: every bench and its twin, eager and torch.compile, one table, its files in
# $OUT/suite: table.txt, results.json, results.csv, ratios.png, logs.txt). Logs go to $OUT when set (the
# device tool brings $OUT back), else to <build-dir>/logs. With --budget, every step gets a time
# limit so that the summary is still printed before the budget runs out.
#
# GoogleTest, nlohmann-json and cudnn-frontend come from .deps/ when the machine has no package
# (carry ".deps"; fill it with scripts/prepare_carry.sh).
set -uo pipefail

BUILD=build-gpu
SANITIZE=0
RUN_TESTS=1
RUN_BENCH=1
RUN_EXAMPLE=1
TEST_REGEX=""
# Cases that skip in a CUDA build by design (Note [Counting CUDA cases]); --allow-skip adds more.
ALLOW_SKIP="CudaJitConfig\.WithoutCudaEveryCallRaises|OffloadPinned\.WithoutCudaPinningRaisesAndNonBlockingCopiesFallBack|DataLoader\.PinMemoryWithoutCudaIsIgnored|RobustnessMessages\.CudaInABuildWithoutCudaLeadsWithTheCause"
# flame::dist cases that need 2+ GPUs (one rank per GPU on "nccl"); scripts/dist_check.sh runs them on 2.
ALLOW_SKIP="$ALLOW_SKIP|Dist(Collectives|DDP|Zero|Checkpoint|Failure|Launcher)\.[A-Za-z0-9_]+"
SAN_FILTER="CudaJit*:*CudaMatchesCpu*"
RACE_FILTER=""
JOBS=8
SHARDS=0
SHUFFLE_ROUNDS=0
SHUFFLE_SEED=0
BUDGET=0
RUN_SUITE=0
SUITE_BUDGET=400
# graph: a CPU-only case (the capture path without CUDA); GraphStepCuda* covers the GPU.
ALLOW_SKIP="$ALLOW_SKIP|GraphStepHelper\.WithoutCudaCaptureRaises"

usage() { sed -n '2,/^set -uo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --sanitize) SANITIZE=1 ;;
    --no-tests) RUN_TESTS=0 ;;
    --no-bench) RUN_BENCH=0 ;;
    --no-example) RUN_EXAMPLE=0 ;;
    --tests) TEST_REGEX="$2"; shift ;;  # a --gtest_filter (GTEST_FILTER for ctest's processes)
    --allow-skip) ALLOW_SKIP="$ALLOW_SKIP|$2"; shift ;;  # an extended regex of Suite.Case names
    --sanitize-filter) SAN_FILTER="$2"; shift ;;
    --racecheck-filter) RACE_FILTER="$2"; shift ;;
    --jobs) JOBS="$2"; shift ;;
    --gtest-shards) SHARDS="$2"; shift ;;
    --shuffle-rounds) SHUFFLE_ROUNDS="$2"; shift ;;
    --shuffle-seed) SHUFFLE_SEED="$2"; shift ;;  # the first round's seed (default: from the clock)
    --budget) BUDGET="$2"; shift ;;
    --build-dir) BUILD="$2"; shift ;;
    --suite) RUN_SUITE=1; RUN_BENCH=0 ;;  # bench/suite.py instead of the pair joins
    --suite-budget) SUITE_BUDGET="$2"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_run: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
  shift
done

if [[ ! -f CMakeLists.txt || ! -d src || ! -d include/flame ]]; then
  echo "gpu_run: run this from the FLAME repository root" >&2
  exit 2
fi
ROOT=$(pwd)
mkdir -p "$BUILD"
BUILD=$(cd "$BUILD" && pwd)
LOGS="${OUT:-$BUILD/logs}"
mkdir -p "$LOGS"
START=$(date +%s)
SUMMARY=()
STATUS=0

say() { echo "[gpu_run $(( $(date +%s) - START ))s] $*"; }
note() { SUMMARY+=("$*"); }
# Seconds left before the budget (a large number without one).
remaining() {
  if [[ "$BUDGET" -gt 0 ]]; then echo $(( START + BUDGET - $(date +%s) )); else echo 100000; fi
}
# A time limit for a step that leaves `$1` seconds for the steps after it (at least 20 s).
limit() {
  local t=$(( $(remaining) - $1 - 10 ))
  [[ $t -lt 20 ]] && t=20
  echo "$t"
}
# What later steps need, roughly, so that an earlier step cannot eat their time.
reserve_after_tests() { echo $(( (SANITIZE ? 120 : 0) + (RUN_EXAMPLE ? 20 : 0) + (RUN_BENCH ? 150 : 0) + (RUN_SUITE ? SUITE_BUDGET + 30 : 0) )); }

# CMake: $CMAKE when set, else the newest of those on the machine (the CUDA20 dialect with nvcc
# needs a recent one; the PyTorch virtual environment often brings one beside python3).
pick_cmake() {
  if [[ -n "${CMAKE:-}" ]]; then echo "$CMAKE"; return; fi
  local best="" bestv="0" c v
  for c in "$(command -v cmake)" "$(dirname "$(command -v python3 || echo /nonexistent)")/cmake" /usr/local/bin/cmake /usr/bin/cmake; do
    [[ -n "$c" && -x "$c" ]] || continue
    v=$("$c" --version 2>/dev/null | head -1 | awk '{print $3}')
    [[ -z "$v" ]] && continue
    if [[ "$v" != "$bestv" && "$(printf '%s\n%s\n' "$bestv" "$v" | sort -V | tail -1)" == "$v" ]]; then
      best=$c
      bestv=$v
    fi
  done
  echo "${best:-cmake}"
}
CMAKE=$(pick_cmake)
CTEST="$(dirname "$CMAKE")/ctest"
[[ -x "$CTEST" ]] || CTEST=ctest

# ---- the machine ----
GPU_INFO=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
NVCC_INFO=$(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' | head -1)
say "GPU: ${GPU_INFO:-none found}; nvcc ${NVCC_INFO:-not found}; $CMAKE: $("$CMAKE" --version | head -1); $(nproc) cores"
note "machine: ${GPU_INFO:-no GPU found} | nvcc ${NVCC_INFO:-?} | $(nproc) cores"

# ---- build ----
BUILD_LOG="$LOGS/build.log"
MARKER="$BUILD/.gpu_run_start"
touch "$MARKER"
GTEST_ARG=()
[[ -f .deps/googletest/CMakeLists.txt ]] && GTEST_ARG=(-DFLAME_GTEST_SOURCE="$ROOT/.deps/googletest")
say "configure + build in $BUILD (log: $BUILD_LOG)"
t0=$(date +%s)
{
  "$CMAKE" -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLAME_CUDA=ON -DFLAME_CUDA_ARCHS=90 \
    -DFLAME_TESTS=ON -DFLAME_EXAMPLES=ON -DFLAME_BENCH=ON "${GTEST_ARG[@]}" &&
    timeout "$(limit 60)" ninja -C "$BUILD" -k 0 -j "$(nproc)"
} >"$BUILD_LOG" 2>&1
BUILD_RC=$?
BUILD_S=$(( $(date +%s) - t0 ))
if [[ $BUILD_RC -eq 0 ]]; then
  note "build: ok (${BUILD_S} s)"
else
  STATUS=1
  note "build: FAILED (rc $BUILD_RC, ${BUILD_S} s); first errors:"
  while IFS= read -r line; do note "  ${line:0:200}"; done < <(grep -E "error|FAILED|Error" "$BUILD_LOG" | head -12)
fi
say "build rc=$BUILD_RC in ${BUILD_S}s"
# A program counts only when this run built (or confirmed) it, never a stale one.
fresh() { [[ -x "$1" && ( $BUILD_RC -eq 0 || "$1" -nt "$MARKER" ) ]]; }

# ---- tests on CUDA ----
# Note [Counting CUDA cases]: a CUDA run passes only when every case that should run did run and
# passed. Each test process writes its counts and the names of its skipped cases to
# $SUMMARY_DIR (FLAME_TEST_SUMMARY_DIR, tests/main.cpp); the sum over the shards must equal the
# number of cases `flame_tests --gtest_list_tests` lists for the filter, and a skipped case fails
# the run unless it matches ALLOW_SKIP (cases that cannot run in a CUDA build by design). A test
# binary that finds no GPU under FLAME_TEST_DEVICE=cuda exits non-zero before running anything.
TEST_BIN="$BUILD/tests/flame_tests"
SUMMARY_DIR="$BUILD/test-summaries"
# check_counts LABEL SECONDS: adds up $SUMMARY_DIR and notes the verdict.
check_counts() {
  local label="$1" secs="$2" expected ran=0 passed=0 failed=0 skipped=0 whole_bad=0 files=0 f r
  # Listed cases minus disabled ones (a suite or case name DISABLED_* or */DISABLED_*, as GoogleTest).
  expected=$(FLAME_TEST_DEVICE=cuda "$TEST_BIN" --gtest_list_tests ${TEST_REGEX:+--gtest_filter="$TEST_REGEX"} 2>/dev/null |
    awk '/^[^ ]/ { suite = $1; sub(/\.$/, "", suite); next }
         /^  [^ ]/ { t = $1; if (suite ~ /(^|\/)DISABLED_/ || t ~ /(^|\/)DISABLED_/) next; n++ }
         END { print n + 0 }')
  for f in "$SUMMARY_DIR"/*.txt; do
    [[ -f "$f" ]] || continue
    files=$(( files + 1 ))
    r=$(awk '$1 == "ran" {print $2}' "$f")
    failed=$(( failed + $(awk '$1 == "failed" {print $2}' "$f") ))
    if head -1 "$f" | grep -q '^shard - of -'; then
      # A whole-suite process (suite.shuffled): it alone must run every case.
      [[ "${r:-0}" -ne "$expected" ]] && whole_bad=$(( whole_bad + 1 ))
    else
      ran=$(( ran + ${r:-0} ))
      passed=$(( passed + $(awk '$1 == "passed" {print $2}' "$f") ))
      skipped=$(( skipped + $(awk '$1 == "skipped" {print $2}' "$f") ))
    fi
  done
  local unexpected
  unexpected=$(cat "$SUMMARY_DIR"/*.txt 2>/dev/null | awk '$1 == "skipped-case" {print $2}' | sort -u |
    grep -vE "^(${ALLOW_SKIP})$" || true)
  local n_unexpected
  n_unexpected=$(grep -c . <<<"$unexpected")
  note "tests (cuda, $label): expected $expected cases, ran $ran in shards, passed $passed, skipped $skipped ($n_unexpected not allowed); failed $failed (shards and whole-suite runs); ${secs} s"
  if [[ $files -eq 0 ]]; then
    STATUS=1
    note "  FAILED: no test process wrote a summary (no GPU found? the binary exits non-zero without one)"
  fi
  if [[ $ran -ne $expected ]]; then
    STATUS=1
    note "  FAILED: $ran cases ran in the shards, $expected expected"
  fi
  if [[ $whole_bad -ne 0 ]]; then
    STATUS=1
    note "  FAILED: $whole_bad whole-suite run(s) did not run all $expected cases"
  fi
  if [[ $n_unexpected -ne 0 ]]; then
    STATUS=1
    note "  FAILED: skipped cases outside the allow-list:"
    while IFS= read -r line; do note "    $line"; done < <(head -10 <<<"$unexpected")
    [[ $n_unexpected -gt 10 ]] && note "    ... and $(( n_unexpected - 10 )) more"
  fi
  [[ $failed -ne 0 ]] && STATUS=1
}

# run_gtest_shards N SEED LOG LABEL: the test binary itself in N parallel shards (GoogleTest's
# GTEST_TOTAL_SHARDS/GTEST_SHARD_INDEX), in shuffled order when SEED > 0, one log; notes the verdict.
run_gtest_shards() {
  local n="$1" seed="$2" tlog="$3" label="$4" T t0 i rc_line secs
  T=$(limit "$(reserve_after_tests)")
  say "flame_tests on CUDA in $n shards$([[ "$seed" -gt 0 ]] && echo ", shuffle seed $seed"), limit ${T}s (log: $tlog)"
  t0=$(date +%s)
  local shard_dir="$BUILD/shards"
  rm -rf "$shard_dir" "$SUMMARY_DIR"
  mkdir -p "$shard_dir" "$SUMMARY_DIR"
  local args=(--gtest_brief=1)
  [[ -n "$TEST_REGEX" ]] && args+=(--gtest_filter="$TEST_REGEX")
  [[ "$seed" -gt 0 ]] && args+=(--gtest_shuffle --gtest_random_seed="$seed")
  for (( i = 0; i < n; i++ )); do
    ( FLAME_TEST_DEVICE=cuda FLAME_POISON_ALLOC=1 FLAME_TEST_SUMMARY_DIR="$SUMMARY_DIR" \
        FLAME_KERNEL_CACHE="$BUILD/kernel-cache" GTEST_TOTAL_SHARDS=$n GTEST_SHARD_INDEX=$i \
        timeout "$T" "$TEST_BIN" "${args[@]}" >"$shard_dir/$i.log" 2>&1
      echo "shard $i rc=$?" >>"$shard_dir/$i.log" ) &
  done
  wait
  secs=$(( $(date +%s) - t0 ))
  cat "$shard_dir"/*.log >"$tlog"
  for (( i = 0; i < n; i++ )); do
    rc_line=$(tail -1 "$shard_dir/$i.log")
    if [[ "$rc_line" != "shard $i rc=0" ]]; then
      STATUS=1
      note "  shard $i: $rc_line; $(grep -vE '^shard ' "$shard_dir/$i.log" | tail -1 | cut -c1-160)"
      # The order can be replayed: the same shard of the same count with the same seed.
      [[ "$seed" -gt 0 ]] && note "    rerun: GTEST_TOTAL_SHARDS=$n GTEST_SHARD_INDEX=$i FLAME_TEST_DEVICE=cuda flame_tests --gtest_shuffle --gtest_random_seed=$seed"
    fi
  done
  check_counts "$label" "$secs"
  while IFS= read -r line; do note "  failed: $line"; done < <(
    grep -hE '^\[  FAILED  \] [A-Za-z_]' "$shard_dir"/*.log | sed -E 's/^\[  FAILED  \] //; s/ \([0-9]+ ms\)$//' | sort -u | head -15)
  say "tests ($label) in ${secs}s"
}

if [[ $RUN_TESTS -eq 1 && $SHARDS -gt 0 ]]; then
  if fresh "$TEST_BIN"; then
    run_gtest_shards "$SHARDS" 0 "$LOGS/tests.log" "$SHARDS gtest shards"
  else
    STATUS=1
    note "tests (cuda): not run, $TEST_BIN was not built"
  fi
elif [[ $RUN_TESTS -eq 1 ]]; then
  # ctest: the shards CMake registered (Note [Test sharding] in tests/CMakeLists.txt), the shuffled
  # whole-suite run and the install test. --tests becomes GTEST_FILTER for every test process.
  CTEST_LOG="$LOGS/ctest.log"
  if fresh "$TEST_BIN"; then
    T=$(limit "$(reserve_after_tests)")
    say "ctest on CUDA, -j $JOBS${TEST_REGEX:+, GTEST_FILTER=$TEST_REGEX}, limit ${T}s (log: $CTEST_LOG)"
    t0=$(date +%s)
    rm -rf "$SUMMARY_DIR"
    mkdir -p "$SUMMARY_DIR"
    (
      cd "$BUILD" &&
        FLAME_TEST_DEVICE=cuda FLAME_TEST_SUMMARY_DIR="$SUMMARY_DIR" FLAME_KERNEL_CACHE="$BUILD/kernel-cache" \
          env ${TEST_REGEX:+GTEST_FILTER="$TEST_REGEX"} timeout "$T" "$CTEST" --output-on-failure -j "$JOBS"
    ) >"$CTEST_LOG" 2>&1
    CTEST_RC=$?
    TESTS_S=$(( $(date +%s) - t0 ))
    # "100% tests passed, 0 tests failed out of N" or, from newer CTest, "100% tests passed out of N".
    SUMLINE=$(grep -E "[0-9]+% tests passed(, [0-9]+ tests? failed)? out of [0-9]+" "$CTEST_LOG" | tail -1)
    if [[ -n "$SUMLINE" ]]; then
      note "ctest: $SUMLINE (rc $CTEST_RC)"
      [[ $CTEST_RC -ne 0 ]] && STATUS=1
      while IFS= read -r line; do note "  failed: ${line}"; done < <(
        sed -n '/The following tests FAILED:/,$p' "$CTEST_LOG" | grep -E '^[[:space:]]+[0-9]+ - ' | sed -E 's/^[[:space:]]+//' | head -15)
      while IFS= read -r line; do note "  failed case: $line"; done < <(
        grep -hE '^\[  FAILED  \] [A-Za-z_]' "$CTEST_LOG" | sed -E 's/^\[  FAILED  \] //; s/ \([0-9]+ ms\)$//' | sort -u | head -15)
    else
      STATUS=1
      note "ctest: NO summary (rc $CTEST_RC; timed out after ${TESTS_S} s?)"
    fi
    check_counts "ctest shards" "$TESTS_S"
    say "ctest rc=$CTEST_RC in ${TESTS_S}s: ${SUMLINE:-no summary}"
  else
    STATUS=1
    note "tests (cuda): not run, $TEST_BIN was not built"
  fi
fi

# Note [Shuffled rounds]: a case must pass whatever ran before it in its process (memory the pool
# still holds, switches, caches, the current stream). --shuffle-rounds N runs the binary N more
# times in shuffled order, round r with seed S + r and a shard count from 3, 5, 8, 12, 16 in turn, so
# each case meets different neighbours in each round; a failure names the seed, the shard count and
# the shard, which replay that process's order exactly. All rounds write one log, shuffled.log.
if [[ $RUN_TESTS -eq 1 && $SHUFFLE_ROUNDS -gt 0 ]]; then
  if fresh "$TEST_BIN"; then
    [[ "$SHUFFLE_SEED" -gt 0 ]] || SHUFFLE_SEED=$(( $(date +%s) % 90000 + 1 ))
    counts=(3 5 8 12 16)
    : >"$LOGS/shuffled.log"
    for (( r = 0; r < SHUFFLE_ROUNDS; r++ )); do
      if [[ $(remaining) -lt $(( $(reserve_after_tests) + 60 )) ]]; then
        STATUS=1
        note "shuffled rounds: stopped before round $(( r + 1 )) of $SHUFFLE_ROUNDS (budget)"
        break
      fi
      n=${counts[$(( r % ${#counts[@]} ))]}
      run_gtest_shards "$n" $(( SHUFFLE_SEED + r )) "$LOGS/shuffled.round.log" "shuffled round $(( r + 1 )): seed $(( SHUFFLE_SEED + r )), $n shards"
      { echo "===== round $(( r + 1 )): seed $(( SHUFFLE_SEED + r )), $n shards"; cat "$LOGS/shuffled.round.log"; } >>"$LOGS/shuffled.log"
      rm -f "$LOGS/shuffled.round.log"
    done
  else
    STATUS=1
    note "shuffled rounds: not run, $TEST_BIN was not built"
  fi
fi

# ---- compute-sanitizer on subsets: memcheck, and racecheck for shared-memory kernels ----
# sanitize TOOL FILTER LEAVE: runs the tool over the tests of FILTER, leaving LEAVE seconds after it.
sanitize() {
  local tool="$1" filter="$2" leave="$3"
  local log="$LOGS/sanitize-$tool.log"
  if ! command -v compute-sanitizer >/dev/null; then
    note "sanitize: compute-sanitizer not found"
    return
  fi
  if ! fresh "$TEST_BIN"; then
    note "sanitize: not run, $TEST_BIN was not built"
    return
  fi
  local T t0 rc errsum gt
  T=$(limit "$leave")
  say "compute-sanitizer $tool, --gtest_filter=$filter, limit ${T}s (log: $log)"
  t0=$(date +%s)
  # Without the block cache every tensor is its own pool allocation, checked one by one.
  FLAME_CUDA_BLOCK_CACHE=0 FLAME_TEST_DEVICE=cuda FLAME_KERNEL_CACHE="$BUILD/kernel-cache" timeout "$T" \
    compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 20 \
    "$TEST_BIN" --gtest_filter="$filter" --gtest_brief=1 >"$log" 2>&1
  rc=$?
  errsum=$(grep -E "(ERROR|RACECHECK) SUMMARY: [0-9]+ (errors?|hazards?)" "$log" | tail -1 | sed -E 's/^=+ *//')
  gt=$(grep -E '^\[  (PASSED|FAILED) +\]' "$log" | head -2 | tr '\n' ' ')
  note "sanitize ($tool, $filter): rc $rc, ${errsum:-no error summary (timed out?)}; gtest: ${gt:-?} ($(( $(date +%s) - t0 )) s)"
  while IFS= read -r line; do note "  $line"; done < <(
    grep -E '^=+ (Invalid|Program hit|Uninitialized|Race|Barrier|Leaked|Error)' "$log" | sed -E 's/^=+ //' |
      sort | uniq -c | sort -rn | head -4 | cut -c1-200)
  [[ $rc -ne 0 ]] && STATUS=1
}
if [[ $SANITIZE -eq 1 ]]; then
  AFTER=$(( (RUN_EXAMPLE ? 20 : 0) + (RUN_BENCH ? 150 : 0) ))
  if [[ -n "$RACE_FILTER" ]]; then
    sanitize memcheck "$SAN_FILTER" $(( AFTER + 60 ))
    sanitize racecheck "$RACE_FILTER" "$AFTER"
  else
    sanitize memcheck "$SAN_FILTER" "$AFTER"
  fi
fi

# ---- the custom-kernel example, twice: the second run must come from the disk cache ----
if [[ $RUN_EXAMPLE -eq 1 ]]; then
  EX="$BUILD/examples/custom_kernel"
  EX_LOG="$LOGS/example.log"
  if fresh "$EX"; then
    rm -rf "$BUILD/example-kernel-cache"
    {
      echo "== first run (cold cache) =="
      FLAME_KERNEL_CACHE="$BUILD/example-kernel-cache" timeout 60 "$EX"
      echo "rc=$?"
      echo "== second run (new process, same cache) =="
      FLAME_KERNEL_CACHE="$BUILD/example-kernel-cache" timeout 60 "$EX"
      echo "rc=$?"
    } >"$EX_LOG" 2>&1
    RCS=$(grep -E '^rc=' "$EX_LOG" | tr '\n' ' ')
    STATS=$(grep -E 'kernel cache' "$EX_LOG" | sed -E 's/.*: (compiles=.*)/\1/' | tr '\n' '|')
    MISMATCH=$(grep -c MISMATCH "$EX_LOG")
    note "example custom_kernel: ${RCS}mismatches $MISMATCH; cache stats cold|warm: ${STATS:-none}"
    [[ "$RCS" != "rc=0 rc=0 " || "$MISMATCH" -ne 0 ]] && STATUS=1
  else
    note "example custom_kernel: not built"
  fi
fi

# ---- safetensors interop: Python safetensors + PyTorch <-> FLAME on the GPU, both directions ----
if [[ $RUN_EXAMPLE -eq 1 ]]; then
  IX="$BUILD/examples/safetensors_interop"
  IX_LOG="$LOGS/interop_safetensors.log"
  if fresh "$IX"; then
    t0=$(date +%s)
    timeout 120 python3 scripts/interop_safetensors.py --flame-bin "$IX" --device cuda \
      --workdir "$BUILD/interop-safetensors" >"$IX_LOG" 2>&1
    rc=$?
    note "interop safetensors (cuda): rc $rc; steps: $(grep -E '^INTEROP' "$IX_LOG" | sed -E 's/^INTEROP ([a-c]): ([A-Z]+).*/\1 \2/' | tr '\n' ' ')($(( $(date +%s) - t0 )) s)"
    while IFS= read -r line; do note "  ${line:0:200}"; done < <(grep -E '^INTEROP [a-c]: FAIL|^mlp:|error' "$IX_LOG" | head -8)
    [[ $rc -ne 0 ]] && STATUS=1
  else
    note "interop safetensors: not run, $IX was not built"
  fi
fi

# ---- apps/diffusion: its tests on CUDA, the model interop check, a short dit-s training run ----
if [[ $RUN_EXAMPLE -eq 1 ]]; then
  DT="$BUILD/apps/diffusion/diffusion_tests"
  DX_LOG="$LOGS/diffusion.log"
  if fresh "$DT"; then
    t0=$(date +%s)
    FLAME_TEST_DEVICE=cuda timeout "$(limit 200)" "$DT" --gtest_brief=1 >"$DX_LOG" 2>&1
    rc=$?
    note "diffusion_tests (cuda): rc $rc; $(grep -E '^\[  (PASSED|FAILED) ' "$DX_LOG" | tr '\n' ' ')($(( $(date +%s) - t0 )) s)"
    while IFS= read -r line; do note "  ${line:0:200}"; done < <(grep -E '^\[  FAILED  \] [A-Z]' "$DX_LOG" | head -8)
    [[ $rc -ne 0 ]] && STATUS=1
    if [[ -x "$BUILD/apps/diffusion/diffusion_interop" ]]; then
      timeout "$(limit 150)" python3 apps/diffusion/reference/interop.py --bin "$BUILD/apps/diffusion/diffusion_interop" \
        --device cuda >>"$DX_LOG" 2>&1
      rc=$?
      note "diffusion interop (cuda, PyTorch twins): rc $rc; $(grep -E '^interop:' "$DX_LOG" | tail -1)"
      [[ $rc -ne 0 ]] && STATUS=1
      # Checkpoints trained on either side (reference/train.py; flame-diffusion train + export).
      timeout "$(limit 150)" python3 apps/diffusion/reference/interop.py --bin "$BUILD/apps/diffusion/diffusion_interop" \
        --device cuda --models dit-tiny,unet-tiny --trained --train-steps 300 >>"$DX_LOG" 2>&1
      rc=$?
      note "diffusion interop, trained checkpoints (cuda): rc $rc; $(grep -E '^interop:' "$DX_LOG" | tail -1)"
      [[ $rc -ne 0 ]] && STATUS=1
    fi
    if [[ -x "$BUILD/apps/diffusion/flame-diffusion" ]]; then
      T=$(limit 150); [[ $T -gt 90 ]] && T=90
      timeout "$T" "$BUILD/apps/diffusion/flame-diffusion" train --model dit-s --batch 256 --steps 300 --log-every 100 \
        --sample-every 0 --ckpt-every 0 --samples-per-class 4 --no-progress --out "$BUILD/diffusion-run" >>"$DX_LOG" 2>&1
      rc=$?
      note "flame-diffusion train dit-s B256 300 steps (--compile): rc $rc; $(grep -E 'done:' "$DX_LOG" | tail -1 | sed -E 's/^ +//')"
      [[ $rc -ne 0 ]] && STATUS=1
      grep -E '^--compile|compiled step:' "$DX_LOG" | tail -3 | while IFS= read -r line; do note "  ${line:0:200}"; done
    fi
  else
    note "diffusion_tests: not built"
  fi
fi

# ---- benchmarks: FLAME, then PyTorch, joined ----
if [[ $RUN_BENCH -eq 1 ]]; then
  BF="$LOGS/bench_flame.txt"
  BT="$LOGS/bench_torch.txt"
  BC="$LOGS/bench_compare.txt"
  if fresh "$BUILD/bench/bench_ops"; then
    T=$(limit 75)
    say "bench_ops, limit ${T}s"
    timeout "$T" "$BUILD/bench/bench_ops" >"$BF" 2>&1 || echo "# bench_ops rc=$?" >>"$BF"
    # The CUDA runtime's own launch and pool costs: the floor under add_small_host.
    if [[ -x "$BUILD/bench/host_floor" ]]; then
      timeout 60 "$BUILD/bench/host_floor" >>"$BF" 2>&1 || echo "# host_floor rc=$?" >>"$BF"
    fi
  else
    echo "# bench_ops was not built" >"$BF"
  fi
  T=$(limit 5)
  say "bench_torch.py, limit ${T}s"
  PYTHONUNBUFFERED=1 timeout "$T" python3 bench/bench_torch.py >"$BT" 2>&1 || echo "# bench_torch rc=$?" >>"$BT"
  # Families: bench/bench_{nn,train}_<family>.cpp beside its twin bench/bench_..._<family>_torch.py,
  # both printing "BENCH {json}" lines into the same two files.
  for twin in bench/bench_nn_*_torch.py bench/bench_train_*_torch.py; do
    [[ -f "$twin" ]] || continue
    fam=$(basename "$twin" _torch.py)
    if fresh "$BUILD/bench/$fam"; then
      T=$(limit 5)
      say "$fam, limit ${T}s"
      timeout "$T" "$BUILD/bench/$fam" >>"$BF" 2>&1 || echo "# $fam rc=$?" >>"$BF"
    else
      echo "# $fam was not built" >>"$BF"
    fi
    T=$(limit 5)
    say "$(basename "$twin"), limit ${T}s"
    PYTHONUNBUFFERED=1 timeout "$T" python3 "$twin" >>"$BT" 2>&1 || echo "# $(basename "$twin") rc=$?" >>"$BT"
  done
  python3 bench/compare.py "$BF" "$BT" >"$BC" 2>&1
  note "benchmarks (FLAME vs PyTorch, same GPU, same run):"
  while IFS= read -r line; do note "  $line"; done <"$BC"
  while IFS= read -r line; do note "  ${line:2} (see $(basename "$BF"), $(basename "$BT"))"; done < <(grep -hE '^# (bench_|host_floor).* rc=' "$BF" "$BT")
fi

# ---- the benchmark suite (--suite): bench/suite.py, one table, its files under $LOGS/suite ----
if [[ $RUN_SUITE -eq 1 ]]; then
  SUITE_DIR="$LOGS/suite"
  mkdir -p "$SUITE_DIR"
  SB=$(( $(remaining) - 40 ))
  [[ $SB -gt $SUITE_BUDGET ]] && SB=$SUITE_BUDGET
  [[ $SB -lt 60 ]] && SB=60
  say "bench/suite.py, budget ${SB}s (outputs: $SUITE_DIR)"
  t0=$(date +%s)
  # The suite's progress lines go into its logs.txt (appended), so $OUT keeps few files.
  PYTHONUNBUFFERED=1 timeout $(( SB + 60 )) python3 bench/suite.py --build "$BUILD" --out "$SUITE_DIR" \
    --time-budget "$SB" >"$SUITE_DIR/progress.tmp" 2>&1
  rc=$?
  note "benchmark suite (bench/suite.py, budget $SB s): rc $rc in $(( $(date +%s) - t0 )) s; files in $SUITE_DIR"
  if [[ -f "$SUITE_DIR/table.txt" ]]; then
    while IFS= read -r line; do note "  $line"; done <"$SUITE_DIR/table.txt"
  else
    while IFS= read -r line; do note "  $line"; done < <(tail -15 "$SUITE_DIR/progress.tmp")
  fi
  { echo; echo "===== suite.py output"; cat "$SUITE_DIR/progress.tmp"; } >>"$SUITE_DIR/logs.txt"
  rm -f "$SUITE_DIR/progress.tmp"
  [[ $rc -ne 0 ]] && STATUS=1
fi

# ---- summary, last ----
{
  echo
  echo "===== FLAME gpu_run summary ($(( $(date +%s) - START )) s; logs in $LOGS) ====="
  for line in "${SUMMARY[@]}"; do echo "$line"; done
  echo "overall: $([[ $STATUS -eq 0 ]] && echo OK || echo FAILED)"
} | tee "$LOGS/summary.txt"
exit $STATUS
