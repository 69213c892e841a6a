#!/usr/bin/env bash
# The search study on the CPU at 16k (2x SmolLM2-135M's 8k window): the patch `hfpatch search` found on Dracula
# (SEARCH_OUT/best.json) against the fixed rescalings on two books the search never saw, Moby-Dick and A Tale of Two
# Cities: perplexity at 8k and 16k (each book's first 16,384 tokens, fp32), then the search's own needle-driven
# perplexity at 16k (2 samples per book) and passkey retrieval at 16k (10 keys, depth 0.5) for the found patch, yarn:2
# and the other arm with the lowest perplexity at 16k on Moby-Dick, both in bf16 as the search itself scored (a 16k
# forward takes about a third of its fp32 time on a CPU with AMX; what they measure moves by far more than bf16's
# rounding). Every step writes its results file as it goes and the same command resumes it; the results go to
# eval/results/search/.
#   bash eval/search_study.sh [SEARCH_OUT]        (default eval/results/search/dracula_16k)
set -euo pipefail
cd "$(dirname "$0")/.."
SEARCH_OUT=${1:-eval/results/search/dracula_16k}
BOOKS=${BOOKS:-../shared/data/books}
OUT=eval/results/search
PY=${PYTHON:-python}
[ -f "$SEARCH_OUT/best.json" ] || { echo "search_study.sh: $SEARCH_OUT/best.json is missing (run the search first)" >&2; exit 2; }
PATCHES=$($PY -m eval.search_study patches --best "$SEARCH_OUT/best.json")
for book in moby_dick a_tale_of_two_cities; do
  [ -f "$BOOKS/$book.txt" ] || { echo "search_study.sh: $BOOKS/$book.txt is missing" >&2; exit 2; }
done
for book in moby_dick a_tale_of_two_cities; do
  $PY -m hfpatch eval ppl --model smollm2 --patches "$PATCHES" --text-files "$BOOKS/$book.txt" --lengths 8k,16k \
    --tokens-per-doc 16384 --no-plot --out "$OUT/ppl_$book"
done
for book in moby_dick a_tale_of_two_cities; do
  $PY -m eval.search_study needle --patches "$PATCHES" --text-files "$BOOKS/$book.txt" --dtype bfloat16 \
    --out "$OUT/needle_$book.json"
done
KEYS=$($PY -m eval.search_study passkey-arms --ppl "$OUT/ppl_moby_dick/results.json" --best "$SEARCH_OUT/best.json")
$PY -m hfpatch eval passkey --model smollm2 --patches "$KEYS" --lengths 16k --depths 0.5 --trials 10 --dtype bf16 --no-plot \
  --out "$OUT/passkey_16k"
