"""Measuring what a patch did: perplexity at extended lengths and passkey retrieval.

    hfpatch eval ppl ...        (= python eval/perplexity.py ...)   hfpatch.evaluate.perplexity.main
    hfpatch eval passkey ...    (= python eval/passkey.py ...)      hfpatch.evaluate.passkey.main

The logic lives in the package (not in eval/) so that an installed hfpatch can run it.
"""

from .score import LMParts, causal_lm_parts, document_nll, window_nll, windows

__all__ = ["LMParts", "causal_lm_parts", "document_nll", "window_nll", "windows"]
