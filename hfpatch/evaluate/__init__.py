"""Measuring what a patch did. Every evaluation is one file over one shared sweep (sweep.py):

    hfpatch eval ppl ...        perplexity at extended lengths           perplexity.py
    hfpatch eval passkey ...    passkey retrieval                         passkey.py
    hfpatch eval ruler ...      the synthetic RULER tasks                 ruler.py
    hfpatch eval niah ...       needle-in-a-haystack depth x length map   niah.py
    hfpatch lm-eval ...         lm-evaluation-harness with --model hfpatch   harness.py

The logic lives in the package (not in eval/) so that an installed hfpatch runs it; eval/*.py only call it.
"""

import importlib

# name on the command line -> the module that defines EVALUATION (imported only when that evaluation runs)
EVALUATIONS = {"ppl": "perplexity", "passkey": "passkey", "ruler": "ruler", "niah": "niah"}


def evaluation(name: str):
    """The module of an evaluation: its EVALUATION and main(argv)."""
    return importlib.import_module(f"{__name__}.{EVALUATIONS[name]}")
