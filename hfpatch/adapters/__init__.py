"""Where a model keeps its blocks, attention, MLP, norms, rotary modules and position tables.

Read off the live model (`infer`: one probe forward on a few tokens), once per model object, then cached on it.
What inference cannot see is written by hand, as data, in one table (`OVERRIDES`, model_type -> Adapter fields),
the way peft keeps one table of model type -> target modules.
"""

from __future__ import annotations

import dataclasses

from transformers import PreTrainedModel

from .base import Adapter, NormClass, get_path
from .infer import InferenceError, classify_norm, infer

# Fields inference cannot read, per model_type. Each entry says why.
OVERRIDES: dict[str, dict] = {
    # OPT keeps its MLP as two linears in the block (no MLP module whose output the probe could follow), and its
    # position table is looked up with positions + 2 computed inside the table's own forward; opt-350m normalizes
    # after the residual add (do_layer_norm_before=False), every other size before it.
    "opt": dict(
        placement=lambda config: "pre" if getattr(config, "do_layer_norm_before", True) else "post",
        residual_readers={"self_attn_layer_norm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                          "final_layer_norm": ("fc1",)},
        residual_writers=("self_attn.out_proj", "fc2"),
        # with word_embed_proj_dim != hidden_size, project_in writes the stream and project_out reads the final norm
        embedding_writers=("decoder.project_in|decoder.embed_tokens", "decoder.embed_positions"),
        final_readers=("decoder.project_out",),
        position_table="decoder.embed_positions",
        position_offset=2,
    ),
    # BERT normalizes inside attention.output and output (dense, dropout, residual add, LayerNorm): post-norm, with
    # a pre-norm form of its own (norm/placement.py).
    "bert": dict(placement="post", placement_layout="bert"),
}

_CACHE = "_hfpatch_adapter"


def adapter_for(model: PreTrainedModel) -> Adapter:
    """The Adapter of a transformers model (inferred once, then cached on the model). InferenceError (a ValueError)
    naming what was not found when the model's structure cannot be read."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"adapter_for needs a transformers PreTrainedModel, got {type(model).__name__}")
    cached = model.__dict__.get(_CACHE)
    if cached is not None:
        return cached
    adapter = infer(model)
    extra = OVERRIDES.get(adapter.model_type)
    if extra:
        adapter = dataclasses.replace(adapter, source="inferred + overrides", **extra)
    set_adapter(model, adapter)
    return adapter


def set_adapter(model: PreTrainedModel, adapter: Adapter) -> None:
    object.__setattr__(model, _CACHE, adapter)


__all__ = ["Adapter", "NormClass", "OVERRIDES", "InferenceError", "adapter_for", "set_adapter", "classify_norm",
           "get_path", "infer"]
