#!/usr/bin/env bash
# The multi-GPU check of flame::dist (docs/distributed.md), on a machine with 2+ GPUs, from the
# repository root, with an existing CUDA build:
#
#   scripts/dist_check.sh build-cuda
#
# Builds nothing. Runs (1) the Dist* tests on "nccl" (FLAME_TEST_DEVICE=cuda), (2) flame-diffusion
# under flame-run on all GPUs for 60 steps, (3) the weak-scaling bench of a dit-s step, 1 vs 2 (vs 4) GPUs,
# FLAME (dist_bench under flame-run) and PyTorch DDP (torchrun) in the same run, with the
# all-reduce/backward overlap from CUDA events, FLAME eager and as one CUDA graph. Prints a summary
# last; exit status 1 if a part failed. About 300 s with the default batches.
set -u
shopt -s lastpipe  # `... | while read; do note; done` runs in this shell, so its notes reach the summary
BUILD="${1:-build-cuda}"
LOGS="$BUILD/dist-check"
mkdir -p "$LOGS"
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off
RUN="$BUILD/tools/flame-run"
STATUS=0
SUMMARY=()
note() { SUMMARY+=("$1"); echo "dist_check: $1"; }
fail() { note "$1"; STATUS=1; }
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
# Per-GPU batches in DIST_BATCHES (default 64 and 256, the trainer's); FLAME modes in DIST_MODES
# (default: eager, graph = one CUDA graph as the trainer's --compile, graph-bf16 = graph with the
# gradients all-reduced in bf16), PyTorch DDP eager (DIST_TORCH=0 skips it).
DB="$BUILD/apps/diffusion/dist_bench"
: >"$LOGS/bench.log"
for B in ${DIST_BATCHES:-64 256}; do
  if [[ -x "$DB" ]]; then
    for mode in ${DIST_MODES:-eager graph graph-bf16}; do
      args=(--mode "${mode%-bf16}")
      [[ $mode == *-bf16 ]] && args+=(--reduce bf16)  # no DDP on one GPU: the 2-GPU runs only
      [[ $mode != *-bf16 ]] && { timeout 60 "$DB" --batch $B "${args[@]}" >>"$LOGS/bench.log" 2>&1 ||
        fail "dist_bench 1 GPU B$B $mode failed"; }
      for g in 2 4 8; do
        [[ $g -le $NGPU ]] || continue
        timeout 80 "$RUN" --nproc-per-node $g "$DB" --batch $B "${args[@]}" >>"$LOGS/bench.log" 2>&1 ||
          fail "dist_bench $g GPUs B$B $mode failed"
      done
    done
  fi
  if [[ "${DIST_TORCH:-1}" == 0 ]]; then
    :
  elif python3 -c "import torch" 2>/dev/null; then
    timeout 60 python3 bench/bench_dist_torch.py --batch $B >>"$LOGS/bench.log" 2>&1 || fail "torch bench 1 GPU failed"
    for g in 2 4 8; do
      [[ $g -le $NGPU ]] || continue
      timeout 90 python3 -m torch.distributed.run --nproc-per-node $g bench/bench_dist_torch.py --batch $B \
        >>"$LOGS/bench.log" 2>&1 || fail "torch bench $g GPUs failed"
    done
  else
    note "PyTorch not installed: no torchrun comparison"
  fi
done
grep -E '^(BENCH|OVERLAP)' "$LOGS/bench.log"
python3 - "$LOGS/bench.log" <<'PY' | while IFS= read -r l; do note "$l"; done
import json, re, sys
rows = {}
for line in open(sys.argv[1]):
    if line.startswith("BENCH "):
        r = json.loads(line[6:])
        m = re.match(r"ddp_step/([^/]+)/b(\d+)_per_gpu/gpus\d+(/graph)?(/bf16reduce)?$", r["name"])
        if not m:
            continue
        kind = r["impl"] + (" graph" if m.group(3) else (" eager" if r["impl"] == "flame" else " DDP"))
        if m.group(4):  # bf16 reduction: 2+ GPUs, against the same mode's one-GPU step
            kind += " bf16-reduce"
        rows.setdefault((int(m.group(2)), kind), {})[r["gpus"]] = r
for (batch, kind), by in rows.items():
    if kind.endswith(" bf16-reduce") and 1 not in by:
        one = rows.get((batch, kind[: -len(" bf16-reduce")]), {}).get(1)
        if one:
            by[1] = one
for (batch, kind), by in sorted(rows.items()):
    one = by.get(1)
    if not one:
        print(f"scaling {kind} {batch}/GPU: no 1-GPU result")
        continue
    parts = [f"1 GPU {one['ms']:.2f} ms/step"]
    for g in (2, 4, 8):
        r = by.get(g)
        if r:
            eff = r["images_per_s"] / (g * one["images_per_s"])
            parts.append(f"{g} GPUs {r['ms']:.2f} ms/step, weak scaling {eff:.1%}")
    print(f"scaling {kind} {batch}/GPU: " + "; ".join(parts))
PY
grep -E '^OVERLAP' "$LOGS/bench.log" | while IFS= read -r l; do note "$l"; done

echo
echo "==== dist_check summary ($(( $(date +%s) - t_start )) s) ===="
for s in "${SUMMARY[@]}"; do echo "$s"; done
echo "status: $([[ $STATUS -eq 0 ]] && echo OK || echo FAILED)"
exit $STATUS
