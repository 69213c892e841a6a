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

    from ..evaluate.common import load_tokenizer

    try:
        if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
            return AutoTokenizer.from_pretrained(name)
        return load_tokenizer(name)
    except (ValueError, OSError) as e:
        raise ConfigError(f"tokenizer: {' '.join(str(e).split())}") from None


def load(cfg):
    """(model, tokenizer) of cfg.model (cfg.tokenizer overrides the tokenizer)."""
    try:
        model, tok = load_model(cfg.model, dtype=dtype_of(cfg), tokenizer=not cfg.tokenizer)
    except (ValueError, OSError) as e:
        raise ConfigError(f"model: {e}") from None
    if cfg.tokenizer:
        tok = tokenizer(cfg.tokenizer)
    if tok is None:
        raise ConfigError(f"model {cfg.model!r} has no tokenizer: set tokenizer: (a folder, .gguf or 'smollm2')")
    check_causal(model)
    return model, tok


def from_config(cfg, tok):
    """A model built from cfg.model_config (a transformers config: model_type and sizes), its vocabulary and special
    tokens taken from the tokenizer unless given, in cfg.dtype (weights drawn from the RNG as seeded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    options = dict(cfg.model_config)
    options.setdefault("vocab_size", len(tok))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        options.setdefault(key, getattr(tok, key))
    try:
        config = AutoConfig.for_model(options.pop("model_type"), **options)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model_config: {e}") from None
    model = AutoModelForCausalLM.from_config(config, dtype=dtype_of(cfg))
    check_causal(model)
    return model


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
