"""Loading what a recipe trains, and the checks that must fail before any training starts."""

from __future__ import annotations

import os
from typing import Any, cast

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

import hfpatch

from ..introspect import position_limit
from ..lm.tokenizer import load_tokenizer
from ..models import load as load_model
from ..position.registry import SCHEMES
from . import init, memory, parallel
from .config import ConfigError, HealConfig, PretrainConfig, RecipeConfig


def dtype_of(cfg: RecipeConfig) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]


def tokenizer(name: str) -> Any:
    """A tokenizer folder (tokenizer files only), a model folder, a .gguf file, a hub id or "smollm2"."""
    try:
        if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
            return AutoTokenizer.from_pretrained(name)
        return load_tokenizer(name)
    except (ValueError, OSError) as e:
        raise ConfigError(f"tokenizer: {' '.join(str(e).split())}") from None


def load(cfg: RecipeConfig) -> tuple[PreTrainedModel, Any]:
    """(model, tokenizer) of cfg.model (cfg.tokenizer overrides the tokenizer)."""
    if not cfg.model:  # a pretrain config builds its model instead (from_config)
        raise ConfigError("model is required (a folder, a .gguf file, a hub id or 'smollm2')")
    try:
        model, tok = load_model(cfg.model, dtype=dtype_of(cfg), tokenizer=not cfg.tokenizer,
                                trust_remote_code=cfg.trust_remote_code,
                                allow_pickled_weights=cfg.allow_pickled_weights)
    except (ValueError, OSError) as e:
        raise ConfigError(f"model: {e}") from None
    if cfg.tokenizer:
        tok = tokenizer(cfg.tokenizer)
    if tok is None:
        raise ConfigError(f"model {cfg.model!r} has no tokenizer: set tokenizer: (a folder, .gguf or 'smollm2')")
    check_causal(model)
    rows = cast(torch.nn.Embedding, model.get_input_embeddings()).num_embeddings
    if len(tok) > rows:  # its last ids would index past the embedding, deep inside the first step
        raise ConfigError(f"the tokenizer has {len(tok)} tokens, the model's embedding {rows} rows: use the model's "
                          "own tokenizer (leave tokenizer: out) or one with at most that many")
    return model, tok


def from_config(cfg: PretrainConfig, tok) -> PreTrainedModel:
    """A model built from cfg.model_config (a transformers config: model_type and sizes), its vocabulary and special
    tokens taken from the tokenizer unless given, in cfg.dtype (weights drawn from the RNG as seeded, the way
    cfg.init names: init.py)."""
    options = dict(cfg.model_config)
    options.setdefault("vocab_size", len(tok))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        options.setdefault(key, getattr(tok, key))
    try:
        config = AutoConfig.for_model(options.pop("model_type"), **options)
        with torch.device("meta"):  # values the config class lets through but no model can be built from: now
            AutoModelForCausalLM.from_config(config)
    except (ValueError, TypeError, AttributeError, RuntimeError, ZeroDivisionError, StrictDataclassError) as e:
        raise ConfigError(f"model_config: {' '.join(str(e).split())}") from None
    model = AutoModelForCausalLM.from_config(config, dtype=dtype_of(cfg))
    check_causal(model)
    return init.apply(model, cfg.init)


def check_causal(model) -> None:
    adapter = hfpatch.adapters.adapter_for(hfpatch.apply.unwrap(model))
    if not adapter.causal or hfpatch.apply.unwrap(model).get_output_embeddings() is None:
        raise ConfigError(f"the recipes train causal language models; {adapter.model_type} "
                          f"({type(hfpatch.apply.unwrap(model)).__name__}) is not one")


def apply_patch(model, cfg: RecipeConfig) -> PreTrainedModel:
    """hfpatch.patch with the config's spec, then the checks that need the patched model: the sequence lengths
    against what the patch supports, PoSE's need for RoPE, mlp_tile's need for a feed-forward module, and what
    cannot train with sequences split over processes (parallel.check)."""
    if cfg.patch:
        try:
            hfpatch.patch(model, **cfg.patch)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"patch: {e}") from None
    limit = position_limit(model)
    info = hfpatch.describe(model)
    spec, scheme = hfpatch.spec.describe_string(info["applied"]), info["position"]["scheme"]
    if limit is not None and cfg.seq_len > limit:
        raise ConfigError(f"seq_len={cfg.seq_len} is above the {limit} positions the model supports with patch "
                          f"{spec!r}; lower seq_len or extend the context (e.g. patch.position=yarn, patch.factor)")
    pose = cfg.pose_positions()
    if pose is not None:
        target_len = pose[0]
        rope = scheme in SCHEMES and SCHEMES[scheme].rope is not None
        if not rope or not hfpatch.adapters.adapter_for(hfpatch.apply.unwrap(model)).has_rope:
            raise ConfigError(f"pose needs a RoPE model (PoSE moves the position ids that RoPE reads); this model's "
                              f"position encoding is {scheme!r}")
        if limit is not None and target_len > limit:
            raise ConfigError(f"pose.target_len={target_len} is above the {limit} positions the model supports "
                              f"with patch {spec!r}; extend the context first (e.g. patch.position=yarn, patch.factor)")
    if cfg.mlp_tile is not None:
        try:
            memory.feed_forward_modules(model)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    head = hfpatch.apply.unwrap(model).get_output_embeddings()
    if cfg.fused_loss and not isinstance(head, torch.nn.Linear):
        raise ConfigError(f"fused_loss needs a linear LM head; this model's is {type(head).__name__}: "
                          "remove fused_loss")
    parallel.check(cfg, scheme)
    return model


def calibrate(model, cfg: HealConfig, train_seqs: torch.Tensor) -> int:
    """hfpatch.calibrate on the first cfg.calibrate training sequences, cfg.batch_size at a time, when the config
    asks for it: what the patch put in (DyT's α, BatchNorm's statistics, Peri-LN's output norms) fit to the model it
    replaced before training starts from it. Every process fits on the same sequences, so all get the same values.
    Returns the number of norms calibrated (0: calibrate is 0)."""
    if not cfg.calibrate:
        return 0
    if cfg.calibrate > len(train_seqs):
        raise ConfigError(f"calibrate={cfg.calibrate} is more than the {len(train_seqs)} training sequences of "
                          f"seq_len={cfg.seq_len}: give at most that many, or more text")
    device = hfpatch.apply.unwrap(model).get_input_embeddings().weight.device
    batches = [b.to(device) for b in train_seqs[: cfg.calibrate].split(cfg.batch_size)]
    try:
        return hfpatch.calibrate(model, batches)
    except ValueError as e:
        raise ConfigError(f"{e}; or set calibrate: 0") from None
