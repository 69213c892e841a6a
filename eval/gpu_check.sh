#!/usr/bin/env bash
# The GPU check: one command on the GPU machine, everything it writes under $OUT (default ./gpu-out):
#   junit.xml (pytest -m cuda), bench_infer.json / bench_train.json (python -m eval.bench_attention --device cuda:
#   each scheme's chosen path against unpatched sdpa and the floors, flex and FlashAttention-4 unmodified),
#   ppl.json (SmolLM2 at 32k in bf16 against the committed CPU cells), check.log, summary.json, summary.md.
# Each step runs under `timeout` with its own budget (together under 8 minutes on one H100); a step that fails or
# runs out of time is recorded and the next one runs.
#   bash eval/gpu_wheels.sh                 # here, once: .whl/, .gpu-data/, .gpu-model/1..3
#   bash eval/gpu_check.sh --stage          # on the GPU machine, once per carried model part but the last
#   bash eval/gpu_check.sh                  # on the GPU machine, carrying .whl, .gpu-data and the last part
#   bash eval/gpu_check.sh --dry-run        # here, on the CPU: the same steps on tiny shapes, CUDA-only ones skipped
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
MODE=gpu
case "${1:-}" in
  "") ;;
  --dry-run) MODE=dry ;;
  --stage) MODE=stage ;;
  *) echo "gpu_check.sh: unknown argument $1 (accepted: --dry-run, --stage)" >&2; exit 2 ;;
esac
OUT=${OUT:-$ROOT/gpu-out}
STAGED=${HFPATCH_GPU_MODEL_DIR:-/tmp/hfpatch-gpu-model}
PY=${PYTHON:-python3}
if [ "$MODE" = stage ]; then
  $PY -m eval.gpu_check model --parts .gpu-model --staged "$STAGED" >/dev/null
  exit 0  # staging a part is not yet having the whole model
fi
mkdir -p "$OUT"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
STEPS=$WORK/steps.jsonl
LOG=$OUT/check.log
: >"$LOG"
export PYTHONUNBUFFERED=1 HFPATCH_CACHE=$WORK/cache TOKENIZERS_PARALLELISM=false

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

# ---- wheels: install the carried ones (GPU), or check them without touching the venv (dry run)
if [ "$MODE" = gpu ]; then
  step install 60 "the carried wheels in $WORK/site" \
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl
  export PYTHONPATH=$WORK/site:$ROOT
else
  step wheels 60 "every pinned wheel present; the ones Python $($PY -c 'import sys; print(*sys.version_info[:2], sep=".")') takes imported from a scratch folder, the cp312-only ones checked by metadata" \
    $PY -m eval.gpu_check wheels --dir .whl --try-import "$WORK/scratch-site"
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi
DRY=""; [ "$MODE" = dry ] && DRY=--dry-run
$PY -m eval.gpu_check env $DRY | tee "$WORK/env.json" | tee -a "$LOG"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$LOG"

# ---- the CUDA tests (skipped with their reasons on the CPU)
step tests 100 "pytest -m cuda" \
  $PY -m pytest -q -m cuda -rs -p no:cacheprovider --junitxml="$OUT/junit.xml" tests/

# ---- the attention benchmark: each scheme's chosen path against unpatched sdpa and the floors (the unpatched model
# on flex_attention and on FlashAttention-4, nothing modified; flash-attn where installed), inference at 8k and 32k,
# training at 8k and 32k (Dual Chunk Attention, T5 and XL train without the written-out path's [L, L] weights)
if [ "$MODE" = gpu ]; then
  BENCH=(--device cuda --dtype bf16 --layers 4 --repeats 3)
  LENGTHS=(8192,32768 8192,32768)
  BUDGET=(110 140)
else
  BENCH=(--device cpu --dtype bf16 --layers 1 --repeats 1)
  LENGTHS=(256 256)
  BUDGET=(60 60)
fi
i=0
for mode in infer train; do
  step "bench-$mode" "${BUDGET[$i]}" "bench_$mode.json" \
    $PY -m eval.bench_attention "${BENCH[@]}" --lengths "${LENGTHS[$i]}" --mode $mode \
    --budget-s $(( ${BUDGET[$i]} - 35 )) --out "$WORK/bench-$mode"
  cp "$WORK/bench-$mode/bench.json" "$OUT/bench_$mode.json" 2>/dev/null
  i=$((i + 1))
done

# ---- one recipe step with the FSDP2 accelerate config, on one process (tiny model, the default corpus)
TINY="model_config={model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 128}"
if [ "$MODE" = gpu ]; then
  ACCEL=recipes/accelerate/fsdp.yaml; RECIPE_NOTE="FSDP2 (recipes/accelerate/fsdp.yaml), one GPU"
else
  ACCEL=recipes/accelerate/cpu.yaml
  RECIPE_NOTE="recipes/accelerate/cpu.yaml: FSDP2 needs CUDA (accelerate sends a CPU run to DDP), so the FSDP2 config is not exercised here"
fi
step recipe 75 "$RECIPE_NOTE" bash -c "
  $PY recipes/train_tokenizer.py --vocab-size 384 --out '$WORK/tok' >/dev/null &&
  $PY -m accelerate.commands.launch --config_file $ACCEL --num_processes 1 recipes/pretrain.py \
    '$TINY' tokenizer='$WORK/tok' seq_len=128 batch_size=2 max_steps=1 eval_every=1 save_every=1 \
    warmup_steps=0 output_dir='$WORK/recipe' && test -f '$WORK/recipe/log.jsonl'"

# ---- SmolLM2 at 32k in bf16: yarn:4, self-extend, dual-chunk, against the committed CPU cells
SPECS=yarn:4,self-extend:group_size=8:window=1024,dual-chunk
TEXT=.gpu-data/moby_dick.txt
MODEL=$($PY -m eval.gpu_check model --parts .gpu-model --staged "$STAGED" 2>"$WORK/model.txt")
if [ -z "$MODEL" ] && [ "$MODE" = dry ]; then
  MODEL=$($PY -c "from hfpatch.models import smollm2_path; print(smollm2_path())" 2>/dev/null)
fi
if [ -z "$MODEL" ]; then
  record ppl skipped 0 "SmolLM2's GGUF is not here: $(cat "$WORK/model.txt")"
elif [ ! -f "$TEXT" ]; then
  record ppl skipped 0 "$TEXT is missing (bash eval/gpu_wheels.sh copies it)"
elif [ "$MODE" = gpu ]; then
  PPL=(--model "$MODEL" --patches $SPECS --text-files "$TEXT" --no-plot --no-memory-check)
  step ppl 130 "bf16 on the GPU vs the committed fp32 CPU cells (eval/results/self_extend/ppl_32k.json, dual_chunk/ppl_32k.json)" bash -c "
    $PY -m hfpatch.cli eval ppl ${PPL[*]@Q} --dtype bf16 --device cuda --lengths 32k --tokens-per-doc 32768 \
      --out '$WORK/ppl' &&
    $PY -m eval.gpu_check ppl-compare '$WORK/ppl/results.json' --out '$OUT/ppl.json' \
      --reference eval/results/self_extend/ppl_32k.json eval/results/dual_chunk/ppl_32k.json"
else  # the same cells at 256 tokens on the CPU, bf16 against fp32 (the comparison's code; the 32k cells need a GPU)
  PPL=(--model "$MODEL" --patches $SPECS --text-files "$TEXT" --no-plot --device cpu --lengths 256 --tokens-per-doc 256)
  step ppl 120 "256 tokens on the CPU, bf16 vs fp32 (the 32k GPU cells are compared with the committed CPU ones)" bash -c "
    $PY -m hfpatch.cli eval ppl ${PPL[*]@Q} --dtype fp32 --out '$WORK/ppl-fp32' >/dev/null &&
    $PY -m hfpatch.cli eval ppl ${PPL[*]@Q} --dtype bf16 --out '$WORK/ppl' >/dev/null &&
    $PY -m eval.gpu_check ppl-compare '$WORK/ppl/results.json' --out '$OUT/ppl.json' \
      --reference '$WORK/ppl-fp32/results.json'"
fi

$PY -m eval.gpu_check summary --steps "$STEPS" --out "$OUT" $DRY
