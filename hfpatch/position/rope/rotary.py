"""Putting RoPE parameters into a live rotary module, and finding a model's rotary modules (`rotaries_of`).

Transformers' rotary classes are per-family copies with one interface: a flat layout (`inv_freq`,
`original_inv_freq`, `attention_scaling`, `rope_type`) or, when `config.rope_parameters` is nested per layer type
(gemma3), one `{layer_type}_*` set per type. `rebuild` redoes what the class's `__init__` does from a config, so the
result is the module a natively configured model would have built (logits identical, diff 0.0).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ...adapters import Adapter, get_path
from ...adapters.positions import layer_types, params_of, prefix
from ...edits import Edits
from .builders import dynamic_yarn_scale, yarn_parameters_at

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel


def rotaries_of(model: PreTrainedModel, adapter: Adapter) -> list:
    """[(rotary module, the config it reads)], the model's own (text) config first."""
    out = []
    for path in adapter.rotaries:
        rotary = get_path(model.base_model, path)
        config = getattr(rotary, "config", None)
        if config is None or getattr(config, "rope_parameters", None) is None:
            raise ValueError(f"{adapter.model_type}: the rotary module {path} ({type(rotary).__name__}) keeps no "
                             "config with rope_parameters, so hfpatch cannot rebuild it")
        out.append((rotary, config))
    return out


def compute(rotary: Any, config: Any, layer_type: Any) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_scaling) for one layer type, by transformers' own functions. A heterogeneous config
    (per-layer head dims, gemma4) is resolved for the layer type first, as the rotary classes' __init__ does."""
    rope_type = params_of(config, layer_type)["rope_type"]
    fn = rotary.compute_default_rope_parameters if rope_type == "default" else ROPE_INIT_FUNCTIONS[rope_type]
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    if layer_type is not None and getattr(config, "is_heterogeneous", False):
        config = config.per_layer_config[layer_type]
    return fn(config, device=None, **kwargs)


def fitted(inv_freq: torch.Tensor, old: torch.Tensor) -> torch.Tensor | None:
    """`inv_freq` in the shape of the buffer it replaces: rotary types that keep a frequency per channel pair and
    set the unrotated ones to 0 ("proportional" partial rotation) get the new frequencies padded with zeros. None
    when it cannot fit."""
    if inv_freq.shape == old.shape:
        return inv_freq
    n = inv_freq.numel()
    if inv_freq.dim() == 1 and old.dim() == 1 and n < old.numel() and not old[n:].any():
        return torch.cat([inv_freq.to(old.dtype), torch.zeros(old.numel() - n, dtype=old.dtype, device=old.device)])
    return None


def _put(rotary: Any, layer_type: str | None, inv_freq: torch.Tensor, scaling: float,
         set_attr: Callable[[nn.Module, str, Any], None]) -> None:
    """Write inv_freq/attention_scaling where the class reads them, on the device and dtype the old buffer had."""
    p = prefix(layer_type)
    old = getattr(rotary, f"{p}inv_freq")
    new = fitted(inv_freq.to(device=old.device, dtype=old.dtype), old)
    if new is None:
        raise ValueError(f"{type(rotary).__name__}: the new RoPE parameters give {inv_freq.numel()} frequencies "
                         f"for layer type {layer_type}, the model rotates with {old.numel()}")
    set_attr(rotary, f"{p}inv_freq", new)
    set_attr(rotary, f"{p}attention_scaling", scaling)


def rebuild(rotary: Any, config: PreTrainedConfig, edits: Edits) -> None:
    """Recompute every rotary buffer and attribute from `config`, as the rotary class's __init__ would."""
    edits.track_new_attributes(rotary)
    if getattr(config, "max_position_embeddings", None) is not None:  # RecurrentGemma's config names no window
        edits.set(rotary, "max_seq_len_cached", config.max_position_embeddings)
        edits.set(rotary, "original_max_seq_len", config.max_position_embeddings)
    types = layer_types(config)
    rope_type = {}
    for lt in types:
        params = params_of(config, lt)
        if params is None:  # a layer type without RoPE
            continue
        inv_freq, scaling = compute(rotary, config, lt)
        _put(rotary, lt, inv_freq, scaling, edits.set)
        p = prefix(lt)
        edits.set(rotary, f"{p}original_inv_freq", getattr(rotary, f"{p}inv_freq").clone())
        # caches that transformers' dynamic/longrope updates leave behind
        edits.delete(rotary, f"{p}long_inv_freq")
        if lt is not None:
            edits.delete(rotary, f"{lt}_max_seq_len_cached")
        rope_type[lt] = params["rope_type"]
    edits.set(rotary, "rope_type", rope_type[None] if types == [None] else rope_type)


class DynamicYarnRotary:
    """Mixed into a family's rotary class for position="dynamic-yarn": before each forward, the YaRN scale is set
    from the sequence length, s = max(1, L / L_orig) (YaRN paper §3.3), and inv_freq / attention scaling are
    recomputed when s changes, in either direction (so a short sequence after a long one is plain RoPE again).

    The module's rope_type stays "default", which keeps transformers' own `dynamic_rope_update` inert here.
    """

    # set by `make_dynamic_yarn`: {"base": {layer_type: params}, "window": int, "opts": dict, "scale": float}
    hfpatch_dynamic_yarn: dict

    def forward(self, x, position_ids, *args, **kwargs):
        refresh_dynamic_yarn(self, int(position_ids.max()) + 1)
        return super().forward(x, position_ids, *args, **kwargs)


def refresh_dynamic_yarn(rotary: Any, seq_len: int) -> None:
    state = rotary.hfpatch_dynamic_yarn
    s = dynamic_yarn_scale(seq_len, state["window"], state["opts"].get("factor"))
    if s == state["scale"]:
        return
    cfg = copy.copy(rotary.config)
    for lt, base in state["base"].items():
        params = yarn_parameters_at(base, state["window"], state["opts"], seq_len)
        cfg.rope_parameters = params if lt is None else {**cfg.rope_parameters, lt: params}
        inv_freq, scaling = compute(rotary, cfg, lt)
        _put(rotary, lt, inv_freq, scaling, setattr)
    state["scale"] = s


def make_dynamic_yarn(rotary: Any, base: dict, window: int, opts: dict, edits: Edits) -> None:
    edits.mix_in(rotary, DynamicYarnRotary)
    edits.set(rotary, "hfpatch_dynamic_yarn", {"base": base, "window": window, "opts": dict(opts), "scale": 1.0})


