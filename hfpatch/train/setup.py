"""Loading what a recipe trains, and the checks that must fail before any training starts."""

from __future__ import annotations

import os

import torch

import hfpatch

from ..models import load as load_model
from .config import ConfigError


def dtype_of(cfg):
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]


def tokenizer(name: str):
    """A tokenizer folder (tokenizer files only), a model folder, a .gguf file, a hub id or "smollm2"."""
    from transformers import AutoTokenizer

    from ..text import load_tokenizer

    try:
        if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
            return AutoTokenizer.from_pretrained(name)
        return load_tokenizer(name)
    except (ValueError, OSError) as e:
        raise ConfigError(f"tokenizer: {' '.join(str(e).split())}") from None


def load(cfg):
    """(model, tokenizer) of cfg.model (cfg.tokenizer overrides the tokenizer)."""
    try:
        model, tok = load_model(cfg.model, dtype=dtype_of(cfg), tokenizer=not cfg.tokenizer,
                                trust_remote_code=cfg.trust_remote_code, allow_pickled_weights=cfg.allow_pickled_weights)
    except (ValueError, OSError) as e:
        raise ConfigError(f"model: {e}") from None
    if cfg.tokenizer:
        tok = tokenizer(cfg.tokenizer)
    if tok is None:
        raise ConfigError(f"model {cfg.model!r} has no tokenizer: set tokenizer: (a folder, .gguf or 'smollm2')")
    check_causal(model)
    rows = model.get_input_embeddings().num_embeddings
    if len(tok) > rows:  # its last ids would index past the embedding, deep inside the first step
        raise ConfigError(f"the tokenizer has {len(tok)} tokens, the model's embedding {rows} rows: use the model's "
                          "own tokenizer (leave tokenizer: out) or one with at most that many")
    return model, tok


def check_causal(model):
    adapter = hfpatch.adapters.adapter_for(hfpatch.apply.unwrap(model))
    if not adapter.causal or hfpatch.apply.unwrap(model).get_output_embeddings() is None:
        raise ConfigError(f"the recipes train causal language models; {adapter.model_type} "
                          f"({type(hfpatch.apply.unwrap(model)).__name__}) is not one")


def apply_patch(model, cfg):
    """hfpatch.patch with the config's spec, then the sequence-length check against what the patch supports."""
    if cfg.patch:
        try:
            hfpatch.patch(model, **cfg.patch)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"patch: {e}") from None
    limit = hfpatch.apply.position_limit(model)
    if limit is not None and cfg.seq_len > limit:
        spec = hfpatch.spec.describe_string(hfpatch.describe(model)["applied"])
        raise ConfigError(f"seq_len={cfg.seq_len} is above the {limit} positions the model supports with patch "
                          f"{spec!r}; lower seq_len or extend the context (e.g. patch.position=yarn, patch.factor)")
    return model
