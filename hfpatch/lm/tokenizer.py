"""A model's tokenizer, loaded by the model's name, after checking from its config alone that the model is a causal
LM (transformers' Auto classes: kept out of text.py, which the evaluation modules import at their top)."""

from __future__ import annotations

import os

from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from ..interop import gguf_cache
from ..models import resolve
from .causal import check_causal_config


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The tokenizer of a model (hub id, folder, .gguf, "smollm2"), after checking from its config alone that the
    model is a causal LM: both before any weights are loaded, so that those errors come at once."""
    where, gguf_file = resolve(name)
    if not gguf_file:
        try:
            config = AutoConfig.from_pretrained(where)
        except (OSError, ValueError):
            config = None  # loading the model will say what is wrong with it
        if config is not None:
            check_causal_config(config)
    try:
        if gguf_file:  # converted once, then from hfpatch's cache (interop/gguf_cache.py)
            return gguf_cache.load_tokenizer(os.path.join(where, gguf_file))
        return AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load a tokenizer for {name!r}: {str(e).strip().splitlines()[0]}") from None
