"""Measuring what a patch did. Every evaluation is one module of evaluations/, named by its command, over one shared
sweep (sweep.py):

    hfpatch eval ppl ...        perplexity at extended lengths           evaluations/ppl.py
    hfpatch eval passkey ...    passkey retrieval                         evaluations/passkey.py
    hfpatch eval ruler ...      the synthetic RULER tasks                 evaluations/ruler.py
    hfpatch eval niah ...       needle-in-a-haystack depth x length map   evaluations/niah.py
    hfpatch lm-eval ...         lm-evaluation-harness with --model hfpatch   harness.py

From Python, `run(name, model, tokenizer, **settings)` and one function per evaluation (`perplexity`, `passkey`,
`ruler`, `niah`) run the same sweep and return what results.json holds (api.py).

A module there is an evaluation by being there: EVALUATIONS, the registry of evaluations, holds the folder's modules
by name (without importing them, so `hfpatch --help` stays fast); the module defines EVALUATION, which takes its
name from the module. An evaluation from elsewhere is registered with `evaluations.register(NAME, MODULE)`
(docs/extending.md).
"""

from __future__ import annotations

from typing import Any

from .evaluations import EVALUATIONS as EVALUATIONS  # the folder lists itself
from .evaluations import evaluation as evaluation

_API = ("run", "perplexity", "passkey", "ruler", "niah")


def __getattr__(name: str) -> Any:
    """The Python API (api.py), imported on first use: the command reads EVALUATIONS without importing torch."""
    if name in _API:
        from . import api  # the CLI's lazy loading: `hfpatch --help` must not import torch

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
