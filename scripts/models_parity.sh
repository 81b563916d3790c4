#!/usr/bin/env bash
# The real model families (apps/diffusion/models) against diffusers on a GPU machine, in one call,
# with a short summary printed LAST (apps/diffusion/README.md, "Models and checkpoint files").
#
#   scripts/models_parity.sh [--build-dir DIR] [--stages LIST] [--budget SECONDS]
#
# Stages (comma-separated, in this order; default: refs,tests,vae,unet):
#   refs       the reduced-configuration reference files of the CPU tests (models_vae.py --reduced,
#              models_unet.py --config tiny-xl/tiny-sd), written to $OUT/refs (the device tool
#              brings $OUT back; commit them under apps/diffusion/tests/data/models/)
#   tests      diffusion_tests' model suites on the CPU (against those references) and on CUDA
#   vae        each VAE (sd, sdxl, sd3, flux) at 256² in f32 and bf16: diffusers makes it with
#              random weights, saves both file formats and its outputs; vae_parity compares
#   vae1024    the same at 1024² (VAE_CONFIGS="sdxl flux" limits the families of both stages)
#   unet       the SDXL UNet on 128x128 latents, f32 and bf16: outputs and LoRA gradients
#   time       bf16 timings beside diffusers: VAE decode/encode at 1024² (sdxl, flux; eager and
#              torch.compile, tiled and untiled, and the tiled-vs-untiled difference of both), the
#              SDXL UNet LoRA r16 training step (batch 1 and 4, with and without gradient
#              checkpointing and RecomputeCheap; batch 1 also as one CUDA graph; batch 1 at the trainer's
#              precision, f32 adapters under autocast, on both sides) and a kernel trace
#   compile    the SDXL UNet step under torch.compile (slow to compile: its own stage)
#   finetune   the LoRA training loop of diffusers' scripts (reference/finetune_loop.py: SDXL, FLUX-dev at
#              1024², bf16 weights and autocast, f32 adapters, 20 AdamW steps) replayed by
#              finetune_parity: the loss of every step and the adapters after the last
#   finetune_e2e  `flame-diffusion finetune --config` end to end (E2E_FAMILIES, default flux sdxl; sd3 is
#              SD3.5-Large): a
#              pipeline folder of random weights at the real configuration and 8 captioned 1024-class
#              images (reference/make_pipeline.py), then 20 LoRA r16 steps from the text and latent
#              caches (the targets of the per-step timings), its median step and peak memory, beside
#              diffusers + peft's step on the same model (models_flux.py / models_sd3.py / models_unet.py --time;
#              E2E_REFERENCE=0 leaves that out; E2E_SET="key=value ..." runs the trainer a second time
#              with those settings, e.g. train.recompute_cheap=true)
#   text       the text encoders (clip-l, clip-g, t5-xxl; TEXT_CONFIGS limits them) in f32 and bf16:
#              transformers makes each with random weights and saves every layout FLAME loads
#              (sharded transformers folder, SDXL/SD3/ComfyUI single files, fp8-scaled T5) and its
#              outputs (models_text.py); text_parity compares. Needs transformers, not diffusers.
#   sd3        the SD3 / SD3.5 transformers (SD3_CONFIGS, default sd3-medium sd3.5-medium in f32 and
#              bf16, sd3.5-large in bf16) on 128x128 latents + 333 text tokens: every file layout
#              (fp8 and fp8-scaled files for the medium models),
#              outputs and LoRA r16 gradients (models_sd3.py writes, sd3_parity check compares); then
#              the SD3.5-Large LoRA r16 step at 1024² (bf16 autocast, f32 adapters) beside diffusers
#              eager and torch.compile, with and without checkpointing every block (and with the
#              checkpointed inputs offloaded), and a kernel trace
#   flux       the FLUX.1 transformer (FLUX_CONFIGS, default flux-dev-d2 in f32 and bf16, flux-dev in
#              bf16; flux-schnell may be added) on 128x128 latents (4096 tokens) + 512 text tokens:
#              every file layout (fp8 files for flux-dev-d2), outputs and LoRA r16 gradients (models_flux.py writes, flux_parity
#              check compares); then the FLUX-dev LoRA r16 step (bf16 autocast, f32 adapters) beside
#              diffusers eager and torch.compile, with and without checkpointing every block (and
#              with the checkpointed inputs offloaded), and a kernel trace
#   fp8        frozen base Linears in 8 bits (docs/float8.md): the FLUX-dev and SD3.5-Large LoRA r16
#              steps with --fp8 none,dequantize,fp8 (same run), and FLUX-dev's loss at each of 50
#              steps per mode from the same start (flux_parity losses: the 8-bit modes, 20 blocks
#              swapped, 8-bit AdamW); FLUX-dev under VRAM budgets (fit_vram_budget) and diffusers'
#              fp8 storage beside it; the SDXL UNet step at 1024² with checkpointing per mode (the
#              "under 10 GiB" row)
#   full       #33's comparison: FLUX-dev full fine-tuning at 1024² on every GPU of the machine, batch 1
#              per GPU, every block recomputed: flame-run + `flux_parity full` (ZeRO-3, bf16 compute over
#              f32 shards, AdamW; with and without the next block's gather prefetched, and where the
#              compute waited for the collectives), then
#              torchrun + reference/fsdp_flux.py (FSDP2 fully_shard per block, the same precision
#              policy), and flame with the trainer's precision (--params bf16: bf16 shards, AdamW's f32
#              masters); one line per rank each (step time, peak memory)
#   full_trainer  `flame-diffusion finetune` with train.method = "full" under flame-run on every GPU
#              (FULL_FAMILIES, default flux sd3): a pipeline folder of random weights at the real
#              configuration (reference/make_pipeline.py: FLUX.1-dev, SD3.5-Large) and 8 captioned
#              images, then FULL_STEPS (default 6) AdamW steps at 1024², batch 1 per rank, ZeRO-3 with
#              gradient checkpointing and the final sharded checkpoint (FULL_SET="key=value ..." adds
#              settings, e.g. train.zero_bucket_mb=2000); each rank's peak memory and the median step.
#              Disk: the pipeline, the weights and every rank's AdamW shard (about 135 GB for
#              SD3.5-Large, 180 GB for FLUX-dev), removed after each family.
#              The time stage adds T5-XXL encoding 16 x 512 tokens and CLIP-L / bigG 64 x 77 (bf16)
#              beside transformers (models_text.py --time, text_parity --time).
# diffusers is not on the GPU machine: its wheel (and importlib_metadata, zipp) comes from .whl/
# (carry it; `pip download --no-deps diffusers==0.42.0 importlib_metadata zipp -d .whl`).
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=build
STAGES=refs,tests,vae,unet
BUDGET=0
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) BUILD=$2; shift 2 ;;
    --stages) STAGES=$2; shift 2 ;;
    --budget) BUDGET=$2; shift 2 ;;
    *) echo "models_parity: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-$BUILD/models_out}
mkdir -p "$OUT"
LOG=$OUT/models.log
SUMMARY=$OUT/models_summary.txt
: > "$SUMMARY"
START=$(date +%s)
say() { echo "[models $(( $(date +%s) - START ))s] $*"; }
note() { echo "$*" >> "$SUMMARY"; }
has() { [[ ",$STAGES," == *",$1,"* ]]; }
# Seconds left of the budget (a large number without one).
left() { if [ "$BUDGET" -gt 0 ]; then echo $(( BUDGET - ($(date +%s) - START) )); else echo 100000; fi; }

# Python: diffusers from the carried wheels when the machine has none.
if ! python3 -c "import diffusers" 2>/dev/null; then
  PYLIB=/tmp/flame_pylib
  if ! python3 -m pip install -q --no-index --no-deps --target "$PYLIB" .whl/*.whl >> "$LOG" 2>&1; then
    note "python: installing .whl/*.whl failed (see $LOG)"
  fi
  export PYTHONPATH=$PYLIB${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import diffusers, torch; print('diffusers', diffusers.__version__, 'torch', torch.__version__)" 2>&1 | tee -a "$SUMMARY"

say "build in $BUILD"
if [ ! -f "$BUILD/build.ninja" ]; then
  eval "$(bash scripts/setup_deps.sh 2>/dev/null)" || true
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release >> "$LOG" 2>&1
fi
# Only what the stages run (a cold build of every tool costs minutes of device time).
TARGETS=""
want() { for t in "$@"; do [[ " $TARGETS " == *" $t "* ]] || TARGETS="$TARGETS $t"; done; }
has refs && want diffusion_tests
has tests && want diffusion_tests flux_parity
{ has vae || has vae1024 || has time; } && want vae_parity
{ has unet || has time || has compile; } && want unet_parity
{ has text || has time; } && want text_parity
has sd3 && want sd3_parity
has flux && want flux_parity
has finetune && want finetune_parity
has finetune_e2e && want flame-diffusion
has fp8 && want flux_parity sd3_parity unet_parity
has full && want flux_parity flame-run
has full_trainer && want flame-diffusion flame-run
[ -z "$TARGETS" ] && want flame-diffusion
if ! ninja -C "$BUILD" $TARGETS >> "$LOG" 2>&1; then
  note "build: FAILED (see $LOG)"; tail -30 "$LOG"; cat "$SUMMARY"; exit 1
fi
note "build: ok ($(( $(date +%s) - START )) s)"
BIN=$BUILD/apps/diffusion
run() {  # run NAME SECONDS CMD...: the output goes to the log; its PASS/FAIL/time lines to the summary
  local name=$1 limit=$2; shift 2
  local l; l=$(left)
  [ "$l" -lt "$limit" ] && limit=$l
  if [ "$limit" -le 5 ]; then note "$name: not run (budget spent)"; return; fi
  say "$name"
  local out rc
  out=$(timeout "$limit" "$@" 2>&1); rc=$?
  printf '== %s (rc %s)\n%s\n' "$name" "$rc" "$out" >> "$LOG"
  local lines; lines=$(echo "$out" | grep -E "PASS|FAIL|ms|GiB|MFU|max abs|error|Error|PASSED|FAILED|SKIPPED|grad |output|loss" | tail -60)
  note "$name (rc $rc):"
  [ -n "$lines" ] && echo "$lines" | sed 's/^/  /' >> "$SUMMARY"
  [ "$rc" -eq 124 ] && note "  timed out after ${limit}s"
}

# pipeline_case STAGE FAMILY: a pipeline folder of random weights at FAMILY's real configuration
# and 8 captioned images (reference/make_pipeline.py) in $pipe and $img, a run folder name in
# $run_dir, and the [model] and [dataset] sections of a trainer configuration reading them in
# /tmp/STAGE_FAMILY.toml (the stage appends the rest).
pipeline_case() {
  local stage=$1 f=$2
  pipe=/tmp/${stage}_pipe_$f img=/tmp/${stage}_images_$f run_dir=/tmp/${stage}_run_$f
  run "$stage $f: random pipeline + images" 600 python3 apps/diffusion/reference/make_pipeline.py --family "$f" \
    --out "$pipe" --images "$img" --device cuda
  printf '[model]\nfamily = "%s"\ncheckpoint = "%s"\n[dataset]\nfolders = ["%s"]\nresolution = 1024\n' \
    "$f" "$pipe" "$img" > "/tmp/${stage}_$f.toml"
}

if has refs; then
  mkdir -p "$OUT/refs"
  run "refs: vae reduced" 300 python3 apps/diffusion/reference/models_vae.py --reduced --out "$OUT/refs"
  run "refs: unet tiny-xl" 300 python3 apps/diffusion/reference/models_unet.py --config tiny-xl --out "$OUT/refs/unet2d-tiny-xl"
  run "refs: unet tiny-sd" 300 python3 apps/diffusion/reference/models_unet.py --config tiny-sd --out "$OUT/refs/unet2d-tiny-sd"
  run "refs: text reduced" 300 python3 apps/diffusion/reference/models_text.py --reduced --out "$OUT/refs"
  run "refs: sd3 tiny-sd3" 300 python3 apps/diffusion/reference/models_sd3.py --config tiny-sd3 --out "$OUT/refs/sd3-tiny"
  run "refs: sd3 tiny-sd35m" 300 python3 apps/diffusion/reference/models_sd3.py --config tiny-sd35m --out "$OUT/refs/sd3-tiny35m"
  run "refs: flux tiny-flux" 300 python3 apps/diffusion/reference/models_flux.py --config tiny-flux --out "$OUT/refs/flux-tiny"
  # The tests read them from the source tree; the tarball is what comes back from the GPU machine
  # (its copy-back keeps few files per folder): unpack it under apps/diffusion/tests/data/models/.
  mkdir -p apps/diffusion/tests/data/models && cp -r "$OUT/refs/." apps/diffusion/tests/data/models/
  tar -C "$OUT" -czf "$OUT/refs.tgz" refs && note "refs: $OUT/refs.tgz"
fi
if has tests; then
  run "tests: models on cpu" 300 "$BIN/diffusion_tests" --gtest_brief=1 --gtest_filter='Models*:UNet2D*'
  run "tests: models on cuda" 300 env FLAME_TEST_DEVICE=cuda "$BIN/diffusion_tests" --gtest_brief=1 --gtest_filter='Models*:UNet2D*'
fi
vae_stage() {  # vae_stage SIZE
  for c in ${VAE_CONFIGS:-sd sdxl sd3 flux}; do
    for d in f32 bf16; do
      local dir=/tmp/vae_${c}_$1_$d
      run "vae $c ${1}² $d: diffusers" 240 python3 apps/diffusion/reference/models_vae.py --config $c --size "$1" --dtype $d --out "$dir"
      run "vae $c ${1}² $d: flame" 240 "$BIN/vae_parity" --dir "$dir"
      rm -rf "$dir"
    done
  done
}
has vae && vae_stage 256
has vae1024 && vae_stage 1024
if has unet; then
  for d in f32 bf16; do
    run "unet sdxl 128 $d: diffusers" 300 python3 apps/diffusion/reference/models_unet.py --config sdxl --latent 128 --dtype $d --out /tmp/unet_sdxl_$d
    run "unet sdxl 128 $d: flame" 300 "$BIN/unet_parity" check --dir /tmp/unet_sdxl_$d --device cuda
    rm -rf /tmp/unet_sdxl_$d
  done
fi
# TIME_PARTS limits the time stage to some of: vae unet text (default all three).
part() { [[ " ${TIME_PARTS:-vae unet text} " == *" $1 "* ]]; }
if has time && part vae; then
  for c in ${VAE_CONFIGS:-sdxl flux}; do
    run "time vae $c: diffusers (eager, tiled vs untiled, torch.compile)" 400 python3 apps/diffusion/reference/models_vae.py \
      --config $c --size 256 --dtype bf16 --out /tmp/vae_t_$c --time --compile
    run "time vae $c: flame" 300 "$BIN/vae_parity" --dir /tmp/vae_t_$c --time
    rm -rf /tmp/vae_t_$c
  done
fi
if has time && part unet; then
  run "time unet sdxl: diffusers" 400 python3 apps/diffusion/reference/models_unet.py --config sdxl --time --batch-list 1,4 --checkpointing 0,1
  # batch 1: eager and one CUDA graph per step, each with and without RecomputeCheap; batch 4 eager.
  run "time unet sdxl b1: flame" 400 "$BIN/unet_parity" time --config sdxl --batch 1 --checkpointing 0,1 --recompute 0,1 --graph 0,1
  run "time unet sdxl b4: flame" 300 "$BIN/unet_parity" time --config sdxl --batch 4 --checkpointing 0,1 --recompute 0,1
  run "time unet sdxl b1: flame kernel trace" 200 "$BIN/unet_parity" time --config sdxl --batch 1 --checkpointing 0 --trace 3
  # The trainer's precision (f32 adapters under bf16 autocast) on both sides: the like-for-like memory row.
  run "time unet sdxl b1, f32 adapters under autocast: diffusers" 300 python3 apps/diffusion/reference/models_unet.py \
    --config sdxl --time --batch-list 1 --checkpointing 0 --adapters f32
  run "time unet sdxl b1, f32 adapters under autocast: flame" 300 "$BIN/unet_parity" time --config sdxl --batch 1 \
    --checkpointing 0 --recompute 0,1 --adapters f32
fi
if has time && part text; then
  for c in ${TEXT_CONFIGS:-t5-xxl clip-l clip-g}; do  # T5 16 x 512, CLIP 64 x 77, bf16
    run "time text $c: transformers" 300 python3 apps/diffusion/reference/models_text.py --config $c --time --out /tmp/text_t_$c
    run "time text $c: flame" 300 "$BIN/text_parity" --time --model $c --device cuda
    rm -rf /tmp/text_t_$c
  done
fi
if has text; then
  for c in ${TEXT_CONFIGS:-clip-l clip-g t5-xxl}; do
    for d in f32 bf16; do
      run "text $c $d: transformers" 600 python3 apps/diffusion/reference/models_text.py --config $c --dtype $d --out /tmp/text_${c}_$d
      run "text $c $d: flame" 600 "$BIN/text_parity" --dir /tmp/text_${c}_$d --device cuda
      rm -rf /tmp/text_${c}_$d
    done
  done
fi
if has sd3; then
  for c in ${SD3_CONFIGS:-sd3-medium sd3.5-medium sd3.5-large}; do
    dtypes="f32 bf16"; [ "$c" = sd3.5-large ] && dtypes=bf16  # 8 B parameters: f32 twice does not fit 80 GB
    for d in $dtypes; do
      fp8=--fp8; [ "$c" = sd3.5-large ] && fp8=  # the fp8 files of the medium models only (disk and time)
      run "sd3 $c 128+333 $d: diffusers" 600 python3 apps/diffusion/reference/models_sd3.py --config $c --latent 128 --text 333 --dtype $d $fp8 --out /tmp/sd3_${c}_$d
      run "sd3 $c 128+333 $d: flame" 600 "$BIN/sd3_parity" check --dir /tmp/sd3_${c}_$d --device cuda
      rm -rf /tmp/sd3_${c}_$d
    done
  done
  run "time sd3.5-large: diffusers" 500 python3 apps/diffusion/reference/models_sd3.py --config sd3.5-large --time --latent 128 --text 333 --checkpointing 0,1
  run "time sd3.5-large: flame" 500 "$BIN/sd3_parity" time --config sd3.5-large --latent 128 --text 333 --checkpointing 0,-1
  run "time sd3.5-large: flame, offloaded checkpoints" 300 "$BIN/sd3_parity" time --config sd3.5-large --latent 128 --text 333 --checkpointing -1 --offload 1
  run "time sd3.5-large: flame kernel trace" 300 "$BIN/sd3_parity" time --config sd3.5-large --latent 128 --text 333 --checkpointing 0 --trace 2
  run "time sd3.5-large: diffusers + torch.compile" 600 python3 apps/diffusion/reference/models_sd3.py --config sd3.5-large --time --compile --latent 128 --text 333 --checkpointing 0
fi
if has flux; then
  for c in ${FLUX_CONFIGS:-flux-dev-d2 flux-dev}; do
    dtypes="f32 bf16"; [ "$c" = flux-dev-d2 ] || dtypes=bf16  # 11.9 B parameters: bf16 only
    for d in $dtypes; do
      fp8=--fp8; [ "$c" = flux-dev-d2 ] || fp8=  # the fp8 files at real widths for the two-block config only (disk and time)
      run "flux $c 128+512 $d: diffusers" 600 python3 apps/diffusion/reference/models_flux.py --config $c --latent 128 --text 512 --dtype $d $fp8 --out /tmp/flux_${c}_$d
      run "flux $c 128+512 $d: flame" 600 "$BIN/flux_parity" check --dir /tmp/flux_${c}_$d --device cuda
      rm -rf /tmp/flux_${c}_$d
    done
  done
  run "time flux-dev: diffusers" 500 python3 apps/diffusion/reference/models_flux.py --config flux-dev --time --latent 128 --text 512 --checkpointing 0,1
  run "time flux-dev: flame" 500 "$BIN/flux_parity" time --config flux-dev --latent 128 --text 512 --checkpointing 0,-1 --recompute 0,1
  run "time flux-dev: flame, offloaded checkpoints" 300 "$BIN/flux_parity" time --config flux-dev --latent 128 --text 512 --checkpointing -1 --offload 1
  run "time flux-dev: flame kernel trace" 300 "$BIN/flux_parity" time --config flux-dev --latent 128 --text 512 --checkpointing 0 --trace 2
  run "time flux-dev: diffusers + torch.compile" 600 python3 apps/diffusion/reference/models_flux.py --config flux-dev --time --compile --latent 128 --text 512 --checkpointing 0
fi
if has finetune; then  # FINETUNE_CONFIGS: family:config pairs; bf16 mixed precision, 20 steps, LoRA r16
  for fc in ${FINETUNE_CONFIGS:-sdxl:sdxl flux:flux-dev}; do
    f=${fc%%:*}; c=${fc#*:}; lat=128; txt=512; [ "$f" = sdxl ] && txt=77
    run "finetune $c: diffusers + peft loop" 600 python3 apps/diffusion/reference/finetune_loop.py --family $f --config $c \
      --model-dir /tmp/ft_model_$c --device cuda --dtype bf16 --latent $lat --text $txt --batch 1 --steps 20 \
      --rank 16 --alpha 16 --lr 1e-4 --out /tmp/ft_ref_$c
    run "finetune $c: flame replay" 600 "$BIN/finetune_parity" check --reference /tmp/ft_ref_$c/finetune_reference.safetensors \
      --model-dir /tmp/ft_model_$c --device cuda
    rm -rf /tmp/ft_model_$c /tmp/ft_ref_$c
  done
fi
if has finetune_e2e; then
  for f in ${E2E_FAMILIES:-flux sdxl}; do
    pipeline_case finetune_e2e "$f"
    cat >> /tmp/finetune_e2e_$f.toml <<EOF
[lora]
rank = 16
alpha = 16
targets = ["to_q", "to_k", "to_v", "to_out.0"]
[train]
steps = 20
log_every = 5
[checkpoint]
every = 0
[output]
dir = "$run_dir"
EOF
    run "finetune_e2e $f: flame-diffusion finetune (caches, 20 steps)" 600 "$BIN/flame-diffusion" finetune \
      --config /tmp/finetune_e2e_$f.toml --device cuda --overwrite
    # E2E_SET="key=value ...": the same run again with those settings (e.g. train.recompute_cheap=true),
    # from the caches the first run wrote.
    if [ -n "${E2E_SET:-}" ]; then
      sets=(); for kv in $E2E_SET; do sets+=(--set "$kv"); done
      run "finetune_e2e $f: flame-diffusion finetune with $E2E_SET" 600 "$BIN/flame-diffusion" finetune \
        --config /tmp/finetune_e2e_$f.toml --device cuda --overwrite "${sets[@]}"
    fi
    if [ "${E2E_REFERENCE:-1}" = 0 ]; then
      note "finetune_e2e $f: diffusers + peft step not run (E2E_REFERENCE=0)"
    elif [ "$f" = flux ]; then
      run "finetune_e2e flux: diffusers + peft step" 500 python3 apps/diffusion/reference/models_flux.py --config flux-dev \
        --time --latent 128 --text 512 --checkpointing 0
    elif [ "$f" = sd3 ]; then
      run "finetune_e2e sd3: diffusers + peft step (SD3.5-Large)" 500 python3 apps/diffusion/reference/models_sd3.py \
        --config sd3.5-large --time --latent 128 --text 333 --checkpointing 0
    else
      run "finetune_e2e sdxl: diffusers + peft step (f32 adapters under bf16 autocast, as the trainer)" 400 python3 \
        apps/diffusion/reference/models_unet.py --config sdxl --time --batch-list 1 --checkpointing 0 --adapters f32
    fi
    rm -rf $pipe $img $run_dir
  done
fi
if has fp8; then
  run "fp8 flux-dev: LoRA r16 step, bf16 / dequantize / fp8" 240 "$BIN/flux_parity" time --config flux-dev \
    --latent 128 --text 512 --checkpointing 0 --fp8 none,dequantize,fp8
  run "fp8 sd3.5-large: LoRA r16 step, bf16 / dequantize / fp8" 200 "$BIN/sd3_parity" time --config sd3.5-large \
    --checkpointing 0 --fp8 none,dequantize,fp8
  run "fp8 flux-dev: loss of 50 steps per mode" 300 "$BIN/flux_parity" losses --config flux-dev --steps 50 \
    --fp8 none,dequantize,fp8
  run "fp8 flux-dev: loss of 50 steps, 20 blocks swapped and 8-bit AdamW" 300 "$BIN/flux_parity" losses \
    --config flux-dev --steps 50 --fp8 none --swap 0,20 --optimizer adamw,adamw8bit
  run "fp8 flux-dev: LoRA r16 step under VRAM budgets (fp8 24 and 16 GiB, bf16 24 GiB)" 300 "$BIN/flux_parity" time \
    --config flux-dev --checkpointing 0 --fp8 fp8 --budget 24,16 --steps 6 --warmup 2
  run "fp8 flux-dev: bf16 base under 24 GiB (block swapping)" 200 "$BIN/flux_parity" time --config flux-dev \
    --checkpointing -1 --fp8 none --budget 24 --steps 4 --warmup 1
  run "fp8 flux-dev: diffusers + peft with fp8 storage (layerwise casting)" 300 python3 \
    apps/diffusion/reference/models_flux.py --config flux-dev --time --fp8-storage --checkpointing 0,1 --steps 5 --warmup 2
  run "fp8 sdxl: UNet LoRA r16 step at 1024², checkpointing, bf16 / fp8 (target: under 10 GiB)" 200 \
    "$BIN/unet_parity" time --config sdxl --batch 1 --checkpointing 1 --fp8 none,dequantize,fp8
fi
if has full; then
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
  [ "$ngpu" -lt 1 ] && ngpu=1
  # With the next block's gather prefetched (the default) and without: what the prefetch hides; each
  # with the wait timeline of one more step (the collectives' exposed time from CUDA events). (A kernel
  # trace, --trace 1, slows the traced rank's step many times over at 4 ranks: not used here.)
  for pf in 1 0; do
    run "full flux-dev: flame ZeRO-3 on $ngpu GPUs (flame-run), prefetch $pf" 600 "$BUILD/tools/flame-run" \
      --nproc-per-node "$ngpu" "$BIN/flux_parity" full --config flux-dev --latent 128 --text 512 --steps 6 --warmup 2 \
      --prefetch $pf --timeline 1
  done
  run "full flux-dev: flame ZeRO-3 on $ngpu GPUs, one bucket per block (one gather and one reduce-scatter each)" 600 \
    "$BUILD/tools/flame-run" --nproc-per-node "$ngpu" "$BIN/flux_parity" full --config flux-dev --latent 128 --text 512 \
    --steps 6 --warmup 2 --bucket-mb 2000 --timeline 1
  run "full flux-dev: flame ZeRO-3 on $ngpu GPUs, the trainer's precision (bf16 shards, f32 masters)" 600 \
    "$BUILD/tools/flame-run" --nproc-per-node "$ngpu" "$BIN/flux_parity" full --config flux-dev --latent 128 --text 512 \
    --steps 6 --warmup 2 --params bf16
  run "full flux-dev: PyTorch FSDP2 on $ngpu GPUs (torchrun)" 600 python3 -m torch.distributed.run --nproc-per-node "$ngpu" \
    apps/diffusion/reference/fsdp_flux.py --config flux-dev --latent 128 --text 512 --steps 6 --warmup 2
fi
if has full_trainer; then
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
  [ "$ngpu" -lt 1 ] && ngpu=1
  for f in ${FULL_FAMILIES:-flux sd3}; do
    pipeline_case full_trainer "$f"
    cat >> /tmp/full_trainer_$f.toml <<EOF
[optimizer]
lr = 1e-5
[train]
method = "full"
steps = ${FULL_STEPS:-6}
batch_size = 1
gradient_checkpointing = true
log_every = 1
[checkpoint]
every = 0
[output]
dir = "$run_dir"
EOF
    sets=(); for kv in ${FULL_SET:-}; do sets+=(--set "$kv"); done
    run "full_trainer $f: flame-diffusion finetune, full, ZeRO-3 on $ngpu GPUs" 600 "$BUILD/tools/flame-run" \
      --nproc-per-node "$ngpu" "$BIN/flame-diffusion" finetune --config /tmp/full_trainer_$f.toml --device cuda --overwrite \
      "${sets[@]}"
    du -sh "$run_dir" 2>/dev/null | sed "s/^/  full_trainer $f: run folder /" >> "$SUMMARY"
    rm -rf "$pipe" "$img" "$run_dir"
  done
fi
# torch.compile of the SDXL UNet step (it may not compile within the limit: then the row says so).
has compile && run "time unet sdxl: diffusers + torch.compile" 420 python3 apps/diffusion/reference/models_unet.py \
  --config sdxl --time --compile --batch-list 1 --checkpointing 0
echo
echo "===== models_parity summary ($(( $(date +%s) - START )) s; log: $LOG) ====="
cat "$SUMMARY"
