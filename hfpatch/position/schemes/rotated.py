"""Schemes whose attention function rotates queries and keys itself, at position maps of its own (Self-Extend, Dual
Chunk Attention).

Transformers' attention function receives q and k after RoPE. Rather than undoing that rotation, the rotary module
is given a class (`OwnRotary`) that hands the attention layers cos = 1, sin = 0, so the family's own
`apply_rotary_pos_emb` leaves q and k as they are, and the scheme's attention function rotates them itself, at each
of its maps, with the rotary module's own cos/sin and the family's own `apply_rotary_pos_emb` (`Rotation.rotate`).
So a map that is the identity sees bit for bit the q and k of the unpatched model, every other map gets one rotation
at its position (not a rotation composed with an inverse one, which would round twice), and no RoPE layout
(rotate-half, interleaved, partial) or per-layer-type frequency (gemma3) is written here. The KV cache holds
un-rotated keys: each call rotates the keys it uses (O(keys x head_dim), small next to the attention itself).
Cached keys' positions are taken as consecutive, ending at the last query's position (true for a DynamicCache, with
or without left padding, and for generate()).

Whether this reproduces the family's attention is checked numerically when patching (`install`): with the scheme's
maps made the identity (`neutral`), the patched model must give the unpatched model's logits on a probe input; if
not, the patch is refused.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from ...adapters import Adapter, get_path
from ...adapters.positions import layer_types, trained_window
from ...adapters.probe import close, probe_logits
from ...edits import Edits
from ..attention import paths
from ..attention.modules import attention_layers
from ..attention.slots import positions as positions  # importable from here too
from ..rope.rotary import rotaries_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class OwnRotary:
    """Mixed into the model's rotary class: the attention layers get cos = 1, sin = 0 (their RoPE leaves q and k
    as they are); `hfpatch_cos_sin` is the class's own forward, for the attention function to rotate with."""

    def forward(self, x, position_ids, *args, **kwargs):
        cos, sin = super().forward(x, position_ids, *args, **kwargs)
        return torch.ones_like(cos), torch.zeros_like(sin)

    def hfpatch_cos_sin(self, x, position_ids, *args):
        return super().forward(x, position_ids, *args)


@dataclass(frozen=True)
class Rotation:
    """How one attention module's model rotates: the rotary module (with OwnRotary mixed in), the layer type it is
    asked for, the family's apply_rotary_pos_emb."""

    rotary: Any
    layer_type: str | None
    apply: Callable

    def rotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [b, heads, n, d] rotated at positions pos [b, n]."""
        cos, sin = self.rotary.hfpatch_cos_sin(x, pos, *(() if self.layer_type is None else (self.layer_type,)))
        return self.apply(x, x[:, :1], cos, sin)[0]  # the second operand is a one-head stand-in, discarded


@dataclass(frozen=True)
class Names:
    """What a scheme registers with transformers, and where its per-module state lives."""

    scheme: str  # the position scheme (and its path table in paths.py)
    sdpa: str  # attention function for models on sdpa or any other implementation
    eager: str  # attention function for models loaded with attn_implementation="eager" (returns the weights)
    state: str  # attribute of each attention module holding the scheme's state


def register(names: Names, sdpa_fn: Callable, eager_fn: Callable) -> None:
    AttentionInterface.register(names.sdpa, sdpa_fn)
    AttentionInterface.register(names.eager, eager_fn)
    AttentionMaskInterface.register(names.sdpa, sdpa_mask)
    AttentionMaskInterface.register(names.eager, eager_mask)


# ------------------------------------------------------------------------------------------------- key slots

def check_cache(scheme: str, attention_mask: torch.Tensor | None, key: torch.Tensor, q_len: int) -> None:
    """Cached keys are taken to end at the newest query: refuse a cache with empty slots after it (a StaticCache),
    where the key positions would come out wrong. The mask alone cannot tell: families that choose which keys a query
    sees (doge's dynamic mask, qwen4_exp's block indexer) can hide the newest slot from the newest query, and
    transformers gives no mask for more queries than one but fewer than keys when the queries are the first slots of
    a static cache. What only an empty slot is: hidden from every query and holding a key that is exactly zero (a
    static cache is allocated, and reset, as zeros; a computed key never is all zeros)."""
    kv_len = key.shape[2]
    if q_len == kv_len or _newest_slot_seen(attention_mask, q_len, kv_len) or bool(key[:, :, -1].any()):
        return
    raise ValueError(f"position={scheme!r} takes cached keys to be consecutive and to end at the newest query "
                     "(a DynamicCache, what generate() uses by default); this cache has empty slots after it "
                     "(a StaticCache?)")


def _newest_slot_seen(attention_mask: torch.Tensor | None, q_len: int, kv_len: int) -> bool:
    """Whether the model's mask lets the newest query (of some batch row and head) see the last key slot. A float
    mask may carry a bias besides the masking (doge's dynamic mask), so a slot counts as seen unless it holds the
    masking value (the dtype's lowest, or -inf)."""
    if attention_mask is None:
        return q_len == 1
    last = attention_mask[:, :, -1, kv_len - 1]
    if last.dtype == torch.bool:
        return bool(last.any())
    return bool((last > torch.finfo(last.dtype).min / 2).any())


# -------------------------------------------------------------------------------------------------------- apply

def rotations(model: PreTrainedModel, adapter: Adapter, scheme: str) -> tuple[list[tuple[torch.nn.Module, Rotation]],
              int]:
    """([(attention module, its Rotation)], the trained window) of a RoPE model whose attention layers all read
    one rotary module."""
    rotaries = rotaries_of(model, adapter)
    if len(rotaries) != 1:
        raise ValueError(f"position={scheme!r} needs to know which rotary module each attention layer reads; "
                         f"{adapter.model_type} has {len(rotaries)} ({', '.join(adapter.rotaries)})")
    rotary, config = rotaries[0]
    types = layer_types(config)
    # a RoPE config names its window
    trained = cast(int, trained_window(config, config.rope_parameters if types == [None] else {}))
    text = model.config.get_text_config()
    layers = get_path(model.base_model, adapter.layers)
    out = []
    for i in attention_layers(model, adapter):
        attn = get_path(layers[i], adapter.attention)
        apply = getattr(inspect.getmodule(type(attn)), "apply_rotary_pos_emb", None)
        if apply is None:
            raise ValueError(f"position={scheme!r} rotates queries and keys with the family's own "
                             f"apply_rotary_pos_emb, and {type(attn).__module__} has none")
        out.append((attn, Rotation(rotary, None if types == [None] else text.layer_types[i], apply)))
    return out, trained


def install(model: PreTrainedModel, adapter: Adapter, names: Names, states: list[tuple[torch.nn.Module, Any]],
            neutral: Callable[[Any], Any], edits: Edits) -> None:
    """Give each attention module its state, the rotary module OwnRotary, and the model the scheme's attention
    function. First, on a probe input, the model with every state made `neutral` (its maps the identity) must give
    the logits it gives now."""
    rotary = states[0][1].rotation.rotary
    check = not any(p.device.type == "meta" for p in model.parameters())  # a reload builds on meta: no check
    before = probe_logits(model, f"position={names.scheme!r}", "as it is") if check else None
    edits.mix_in(rotary, OwnRotary)
    paths.remember_base(model, edits)
    name = names.eager if model.config._attn_implementation == "eager" else names.sdpa
    text = model.config.get_text_config()
    for c in {id(c): c for c in (model.config, text)}.values():
        edits.set(c, "_attn_implementation_internal", name)
    if before is not None:
        for attn, state in states:
            edits.set(attn, names.state, neutral(state))
        after = probe_logits(model, f"position={names.scheme!r}", f"with position={names.scheme!r}")
        if not close(before, after):
            raise ValueError(
                f"position={names.scheme!r} does not reproduce {adapter.model_type}'s own RoPE attention (with its "
                f"position maps made the identity its logits should not change, but they differ by "
                f"{(before.float() - after.float()).abs().max().item():.3g}): its attention layers do not rotate "
                f"queries and keys only by {states[0][1].rotation.apply.__module__}.apply_rotary_pos_emb with the "
                "rotary module's cos/sin")
    for attn, state in states:
        edits.set(attn, names.state, state)

