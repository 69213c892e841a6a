#!/usr/bin/env bash
# The SmolLM2-135M long-context studies that need a GPU (trained window 8k, extended to 32k), each one call of the
# GPU machine after the same staging calls as the GPU check (docs/maintenance.md: "The GPU check"), everything it
# writes under $OUT (default ./gpu-out), the evaluations' results files as they are:
#   bash eval/gpu_study.sh --stage               # on the GPU machine, carrying .gpu-stage/1, 2, ... but the last
#   bash eval/gpu_study.sh temperature           # carrying .gpu-data and the last .gpu-stage part
#   bash eval/gpu_study.sh search                # likewise
#   bash eval/gpu_study.sh heal                  # likewise
#   bash eval/gpu_study.sh temperature --dry-run # here, on the CPU: the same commands at a few hundred tokens
# temperature: attention temperature (none, logn, llama4) on top of the model's own RoPE, yarn:4, Self-Extend and
#   Dual Chunk Attention (their defaults): perplexity at 8k/16k/32k, passkey at 16k/32k (10 keys per cell, depth 0.5).
# search: `hfpatch search` at 32k calibrated on Dracula, then the found patch (saved with `hfpatch patch
#   --spec-file`, evaluated as a folder) against the unpatched model, linear:4, ntk:4, yarn:4, llama3:4, Self-Extend
#   and Dual Chunk Attention on Moby-Dick, which the search never saw: perplexity at 8k/16k/32k, passkey at 16k/32k.
# heal: the shipped heal recipe and config (recipes/configs/heal_smollm2_layernorm.yaml: 60 steps of distillation
#   from the unpatched model on Emma and Jane Eyre) at the trained window, 8k-token sequences instead of its 512
#   (at 512 tokens p-RoPE's unrotated low frequencies barely matter, so that heal has nothing to correct: measured
#   on the CPU, docs/recipes/heal.md), after p-rope (keep 0.75), after the iRoPE pattern (NoPE in every 4th layer)
#   and with no patch (the control); perplexity at 8k/16k/32k before and after on Moby-Dick.
# Each step runs under `timeout` with its own budget (the whole study under 9 minutes on one H200); a step that
# fails or runs out of time is logged and the next one runs; results files are written after every unit, so a step
# stopped by its budget keeps what it finished.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
STAGED=${HFPATCH_GPU_STAGE_DIR:-/tmp/hfpatch-gpu-stage}
STUDY="" MODE=gpu
for a in "$@"; do
  case "$a" in
    temperature|search|heal) STUDY=$a ;;
    --dry-run) MODE=dry ;;
    --stage) MODE=stage ;;
    *) echo "gpu_study.sh: unknown argument $a (accepted: temperature, search, heal, --dry-run, --stage)" >&2; exit 2 ;;
  esac
done
if [ "$MODE" = stage ]; then
  $PY -m eval.gpu_check stage --parts .gpu-stage --staged "$STAGED"
  exit 0
fi
[ -n "$STUDY" ] || { echo "gpu_study.sh: name a study: temperature, search or heal" >&2; exit 2; }
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
LOG=$OUT/$STUDY.log
: >"$LOG"
export PYTHONUNBUFFERED=1 HFPATCH_CACHE=$WORK/cache TOKENIZERS_PARALLELISM=false

step() {  # name budget_s command...: the command under timeout, its output to the log
  local name=$1 budget=$2 t0 rc
  shift 2
  echo "== $name (budget $budget s): $*" | tee -a "$LOG"
  t0=$(date +%s)
  timeout -k 10 "$budget" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
}

if [ "$MODE" = gpu ]; then
  # the staged files: the last part joins them; hfpatch's wheels only (FlashAttention-4's are the check's)
  $PY -m eval.gpu_check stage --parts .gpu-stage --staged "$STAGED"
  WHEELS=$($PY -m eval.gpu_check staged --staged "$STAGED" --group wheels)
  [ -n "$WHEELS" ] || { echo "gpu_study.sh: the staged files are not complete: carry every .gpu-stage part (--stage)" >&2; exit 1; }
  # shellcheck disable=SC2086
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" $WHEELS
  export PYTHONPATH=$WORK/site:$ROOT
  MODEL=$($PY -m eval.gpu_check staged --staged "$STAGED" --group model)
  RUN=(--dtype bf16 --device cuda --no-plot --no-memory-check)
  PPL=(--lengths 8k,16k,32k --tokens-per-doc 32768)
  KEYS=(--lengths 16k,32k --depths 0.5 --trials 10)
  TARGET=32k; SEARCH=(--budget 150s)
  # step budgets in seconds (measured on an H200: a 32k forward of this model well under a second, a passkey trial
  # at 32k about one; compilations of flex_attention 5-15 s each)
  B_SEARCH=200 B_SAVE=40 B_PPL=120 B_KEYS=330 B_FIXED_PPL=90 B_FIXED_KEYS=200 B_FOUND_PPL=40 B_FOUND_KEYS=60
  ACCEL=(--config_file recipes/accelerate/ddp.yaml --num_processes 1); HEAL=(seq_len=8192); B_HEAL=150 B_HEAL_PPL=60
else  # the same commands on the CPU at a few hundred tokens: the plumbing, not the numbers
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
  MODEL=$($PY -c "from hfpatch.models import smollm2_path; print(smollm2_path())")
  RUN=(--dtype fp32 --device cpu --no-plot)
  PPL=(--lengths 256,512 --tokens-per-doc 512)
  KEYS=(--lengths 256 --depths 0.5 --trials 1)
  TARGET=512; SEARCH=(--budget 3 --window 256)
  B_SEARCH=600 B_SAVE=120 B_PPL=300 B_KEYS=300 B_FIXED_PPL=300 B_FIXED_KEYS=300 B_FOUND_PPL=300 B_FOUND_KEYS=300
  ACCEL=(--config_file recipes/accelerate/cpu.yaml --num_processes 1)
  HEAL=(max_steps=1 warmup_steps=0 eval_every=1 save_every=1 eval_batches=1 seq_len=64); B_HEAL=300 B_HEAL_PPL=300
fi
TEXT=.gpu-data/moby_dick.txt
[ -n "$MODEL" ] && [ -f "$TEXT" ] || { echo "gpu_study.sh: the model or $TEXT is missing (bash eval/gpu_wheels.sh)" >&2; exit 1; }
$PY -m eval.gpu_check env $([ "$MODE" = dry ] && echo --dry-run) >"$OUT/$STUDY-env.json"

evaluate() {  # name model patches ppl_budget passkey_budget: perplexity and passkey, their results files into $OUT
  step "$1-ppl" "$4" $PY -m hfpatch.cli eval ppl --model "$2" --patches "$3" --text-files "$TEXT" \
    "${RUN[@]}" "${PPL[@]}" --out "$WORK/$1-ppl"
  cp "$WORK/$1-ppl/results.json" "$OUT/$1-ppl.json" 2>/dev/null
  step "$1-passkey" "$5" $PY -m hfpatch.cli eval passkey --model "$2" --patches "$3" "${RUN[@]}" \
    "${KEYS[@]}" --out "$WORK/$1-passkey"
  cp "$WORK/$1-passkey/results.json" "$OUT/$1-passkey.json" 2>/dev/null
}

if [ "$STUDY" = temperature ]; then
  specs=""
  for base in "" yarn:4 self-extend dual-chunk; do
    for t in "" logn llama4; do
      s=$base
      [ -n "$t" ] && s=${base:+$base+}attention_temperature=$t
      specs=$specs,${s:-none}
    done
  done
  evaluate temperature "$MODEL" "${specs#,}" $B_PPL $B_KEYS
elif [ "$STUDY" = heal ]; then
  declare -A PATCH=([plain]="{}" [p-rope]="{position: p-rope, keep: 0.75}"
                    [irope]="{position: rope, layers: {nope: every4}}")
  ppl() {  # name model patches budget
    step "$1" "$4" $PY -m hfpatch.cli eval ppl --model "$2" --patches "$3" --text-files "$TEXT" "${RUN[@]}" \
      "${PPL[@]}" --out "$WORK/$1"
    cp "$WORK/$1/results.json" "$OUT/$1.json" 2>/dev/null
  }
  ppl heal-before "$MODEL" none,p-rope:keep=0.75,rope+nope@every4 $B_HEAL_PPL
  for arm in plain p-rope irope; do
    step "heal-$arm" $B_HEAL $PY -m accelerate.commands.launch "${ACCEL[@]}" recipes/heal.py \
      --config recipes/configs/heal_smollm2_layernorm.yaml model="$MODEL" "patch=${PATCH[$arm]}" \
      "data.text_files=[.gpu-data/emma.txt, .gpu-data/jane_eyre.txt]" "${HEAL[@]}" output_dir="$WORK/heal-$arm"
    sed "s/^{/{\"arm\": \"$arm\", /" "$WORK/heal-$arm/log.jsonl" >>"$OUT/heal-train.jsonl" 2>/dev/null
    ppl "heal-$arm" "$WORK/heal-$arm/final" none $B_HEAL_PPL
  done
else
  step search $B_SEARCH $PY -m hfpatch.cli search --model "$MODEL" --target-length $TARGET "${SEARCH[@]}" \
    --text-files .gpu-data/dracula.txt "${RUN[@]}" --no-progress --out "$WORK/search"
  cp "$WORK/search/results.json" "$OUT/search.json" 2>/dev/null
  cp "$WORK/search/best.json" "$OUT/search-best.json" 2>/dev/null
  step save $B_SAVE $PY -m hfpatch.cli patch "$MODEL" --spec-file "$WORK/search/best.json" --out "$WORK/found"
  evaluate search-fixed "$MODEL" none,linear:4,ntk:4,yarn:4,llama3:4,self-extend,dual-chunk $B_FIXED_PPL \
    $B_FIXED_KEYS
  evaluate search-found "$WORK/found" none $B_FOUND_PPL $B_FOUND_KEYS
fi
ls -la "$OUT" | tee -a "$LOG"
