"""A model's attention modules, and switching the model to a registered attention function: where the schemes with
an attention function of their own (ALiBi, T5, Transformer-XL, Self-Extend, Dual Chunk Attention) and the attention
temperature keep their per-module state, and how the model comes to call their function."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...adapters import Adapter, get_path
from ...edits import Edits
from . import paths

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def attention_layers(model: PreTrainedModel, adapter: Adapter) -> list[int]:
    """Indices of the blocks that hold `adapter.attention` (all of them, except in hybrid stacks)."""
    n = len(get_path(model.base_model, adapter.layers))
    return list(adapter.attention_layers) if adapter.attention_layers is not None else list(range(n))


def attention_modules(model: PreTrainedModel, adapter: Adapter) -> list:
    """The attention module of every block that has one."""
    layers = get_path(model.base_model, adapter.layers)
    return [get_path(layers[i], adapter.attention) for i in attention_layers(model, adapter)]


def use_attention(model: PreTrainedModel, sdpa_name: str, eager_name: str, edits: Edits) -> None:
    """Switch the model to a registered attention function: `eager_name` if it runs eager attention (which returns
    attention weights), else `sdpa_name`."""
    config = model.config
    paths.remember_base(model, edits)
    name = eager_name if config._attn_implementation == "eager" else sdpa_name
    for c in {id(c): c for c in (config, config.get_text_config())}.values():
        edits.set(c, "_attn_implementation_internal", name)
