"""A model's own position signal as transformers lays it out: what inference reads, and what the position patches
start from.

- The window a config says the model was trained for (`trained_window`).
- How a rotary module keeps its frequencies: flat (`inv_freq`, `original_inv_freq`, `attention_scaling`,
  `rope_type`) or, when `config.rope_parameters` is nested per layer type (gemma3), one `{layer_type}_*` set per
  type (`layer_types`, `params_of`, `prefix`).
- Taking the signal out: a rotary module that rotates nothing (`make_identity`), a learned table whose lookup returns
  zeros (`ZeroPositions`). Inference tries it to see whether anything else encodes position; the patches that
  replace positions (position/patch.remove_positions) do it for good.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ..edits import Edits

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


def trained_window(config: PreTrainedConfig, params: dict | None = None) -> int | None:
    """The context `config` says the model was trained for: the original window of RoPE parameters that are already
    scaled (`params`: one layer type's; by default the config's own, flat or of any layer type), phi3's
    `original_max_position_embeddings`, else `max_position_embeddings`; None where the config names none
    (RecurrentGemma: local attention only)."""
    if params is None:
        own = getattr(config, "rope_parameters", None)
        own = own if isinstance(own, dict) else {}
        sets = [own] + [v for v in own.values() if isinstance(v, dict)]
    else:
        sets = [params]
    named = [getattr(config, name, None) for name in ("original_max_position_embeddings", "max_position_embeddings")]
    for value in [p.get("original_max_position_embeddings") for p in sets] + named:
        # numbers.Real: typeshed gives the ABC no comparison with int nor __int__, which every real number has
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and cast(float, value) > 0:
            return int(cast(float, value))
    return None


def layer_types(config: PreTrainedConfig) -> list:
    """[None] for a flat rope_parameters dict, else the layer types it is nested by."""
    return config.nested_rope_parameter_keys(config.rope_parameters) or [None]


def params_of(config: PreTrainedConfig, layer_type: str | None) -> dict:
    return config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]


def prefix(layer_type: str | None) -> str:
    """What a rotary module's buffers of this layer type are prefixed with ("" for a flat layout)."""
    return "" if layer_type is None else f"{layer_type}_"


def make_identity(rotary: Any, config: PreTrainedConfig, edits: Edits) -> None:
    """RoPE that rotates nothing: inverse frequencies 0 (cos 1, sin 0 at every position), no attention scaling.
    The rope type becomes "default", which keeps transformers' dynamic/longrope updates from recomputing them."""
    edits.track_new_attributes(rotary)
    types = [lt for lt in layer_types(config) if params_of(config, lt) is not None]
    for lt in types:
        p = prefix(lt)
        edits.set(rotary, f"{p}inv_freq", torch.zeros_like(getattr(rotary, f"{p}inv_freq")))
        edits.set(rotary, f"{p}original_inv_freq", torch.zeros_like(getattr(rotary, f"{p}inv_freq")))
        edits.set(rotary, f"{p}attention_scaling", 1.0)
        edits.delete(rotary, f"{p}long_inv_freq")
    edits.set(rotary, "rope_type", "default" if types == [None] else {lt: "default" for lt in types})


class ZeroPositions(nn.Embedding):
    """Mixed in just above nn.Embedding in a learned position table's class (`Edits.mix_in(..., under=True)`): the
    lookup returns zeros, so the model adds no position embedding (gradients do not reach the table)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # `input`: nn.Embedding's own parameter name
        return torch.zeros(*input.shape, self.embedding_dim, dtype=self.weight.dtype, device=self.weight.device)
