#!/usr/bin/env bash
# The multi-GPU check of flame::dist (docs/distributed.md), on a machine with 2+ GPUs, from the
# repository root, with an existing CUDA build:
#
#   scripts/dist_check.sh build-cuda
#
# Builds nothing. Runs (1) the Dist* tests on "nccl" (FLAME_TEST_DEVICE=cuda), (2) flame-diffusion
# under flame-run on all GPUs for 60 steps, (3) the weak-scaling bench of a dit-s step, 1 vs 2 (vs 4) GPUs,
# FLAME (dist_bench under flame-run) and PyTorch DDP (torchrun) in the same run, with the
# all-reduce/backward overlap from CUDA events. Prints a summary last; exit status 1 if a part
# failed. Under 300 s.
set -u
BUILD="${1:-build-cuda}"
LOGS="$BUILD/dist-check"
mkdir -p "$LOGS"
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off
RUN="$BUILD/tools/flame-run"
STATUS=0
SUMMARY=()
note() { SUMMARY+=("$1"); echo "dist_check: $1"; }
t_start=$(date +%s)
command -v nvidia-smi >/dev/null && nvidia-smi -L
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[[ "$NGPU" -ge 2 ]] || NGPU=2

# ---- 1. tests ----
if [[ -x "$BUILD/tests/flame_tests" ]]; then
  t0=$(date +%s)
  FLAME_TEST_DEVICE=cuda timeout 170 "$BUILD/tests/flame_tests" --gtest_filter='Dist*' >"$LOGS/tests.log" 2>&1
  rc=$?
  passed=$(grep -cE '^\[       OK \]' "$LOGS/tests.log")
  failed=$(grep -E '^\[  FAILED  \] Dist' "$LOGS/tests.log" | sed -E 's/ \(.*//' | sort -u | wc -l)
  skipped=$(grep -E '^\[  SKIPPED \] Dist' "$LOGS/tests.log" | sed -E 's/ \(.*//' | sort -u | wc -l)
  note "Dist* tests (nccl): rc $rc, $passed passed, $failed failed, $skipped skipped ($(( $(date +%s) - t0 )) s)"
  grep -E '^\[  (FAILED|SKIPPED) \] Dist' "$LOGS/tests.log" | sort -u | head -20 | while IFS= read -r l; do note "  $l"; done
  [[ $rc -ne 0 ]] && { STATUS=1; grep -E 'check failed|CAUGHT|Failure|error' "$LOGS/tests.log" | head -30; }
else
  note "tests: $BUILD/tests/flame_tests not built"; STATUS=1
fi

# ---- 2. the trainer on 2 GPUs ----
FD="$BUILD/apps/diffusion/flame-diffusion"
if [[ -x "$FD" && -x "$RUN" ]]; then
  t0=$(date +%s)
  timeout 100 "$RUN" --nproc-per-node "$NGPU" "$FD" train --model dit-s --batch 256 --steps 60 --log-every 20 \
    --sample-every 0 --ckpt-every 0 --samples-per-class 2 --no-progress --out "$LOGS/diffusion-run" \
    >"$LOGS/trainer.log" 2>&1
  rc=$?
  note "flame-run --nproc-per-node $NGPU flame-diffusion train dit-s B256 ($((256 / NGPU))/GPU) 60 steps: rc $rc ($(( $(date +%s) - t0 )) s); $(grep -E 'done:' "$LOGS/trainer.log" | tail -1 | sed -E 's/^ +//')"
  [[ $rc -ne 0 ]] && { STATUS=1; tail -20 "$LOGS/trainer.log"; }
else
  note "trainer: flame-diffusion or flame-run not built"; STATUS=1
fi

# ---- 3. scaling bench, FLAME vs PyTorch DDP ----
DB="$BUILD/apps/diffusion/dist_bench"
B=64
: >"$LOGS/bench.log"
if [[ -x "$DB" ]]; then
  timeout 60 "$DB" --batch $B >>"$LOGS/bench.log" 2>&1 || note "dist_bench 1 GPU failed"
  for g in 2 4 8; do
    [[ $g -le $NGPU ]] || continue
    timeout 80 "$RUN" --nproc-per-node $g "$DB" --batch $B >>"$LOGS/bench.log" 2>&1 || note "dist_bench $g GPUs failed"
  done
fi
if python3 -c "import torch" 2>/dev/null; then
  timeout 60 python3 bench/bench_dist_torch.py --batch $B >>"$LOGS/bench.log" 2>&1 || note "torch bench 1 GPU failed"
  for g in 2 4 8; do
    [[ $g -le $NGPU ]] || continue
    timeout 90 python3 -m torch.distributed.run --nproc-per-node $g bench/bench_dist_torch.py --batch $B \
      >>"$LOGS/bench.log" 2>&1 || note "torch bench $g GPUs failed"
  done
else
  note "PyTorch not installed: no torchrun comparison"
fi
grep -E '^(BENCH|OVERLAP)' "$LOGS/bench.log"
python3 - "$LOGS/bench.log" <<'PY' | while IFS= read -r l; do note "$l"; done
import json, sys
rows = {}
for line in open(sys.argv[1]):
    if line.startswith("BENCH "):
        r = json.loads(line[6:])
        rows[(r["impl"], r["gpus"])] = r
for impl in ("flame", "torch"):
    one = rows.get((impl, 1))
    if not one:
        print(f"scaling {impl}: no 1-GPU result")
        continue
    parts = [f"1 GPU {one['ms']:.1f} ms/step {one['images_per_s']:.0f} img/s"]
    for g in (2, 4, 8):
        r = rows.get((impl, g))
        if r:
            eff = r["images_per_s"] / (g * one["images_per_s"])
            parts.append(f"{g} GPUs {r['ms']:.1f} ms/step {r['images_per_s']:.0f} img/s, weak-scaling efficiency {eff:.0%}")
    print(f"scaling {impl}: " + "; ".join(parts))
PY
grep -E '^OVERLAP' "$LOGS/bench.log" | while IFS= read -r l; do note "$l"; done

echo
echo "==== dist_check summary ($(( $(date +%s) - t_start )) s) ===="
for s in "${SUMMARY[@]}"; do echo "$s"; done
echo "status: $([[ $STATUS -eq 0 ]] && echo OK || echo FAILED)"
exit $STATUS
