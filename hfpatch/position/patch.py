"""position=...: RoPE scaling (rescale the live rotary module), alibi / nope / sinusoidal (take the model's own
position signal out, put another in), interpolate (stretch a learned table). Every change goes through `Edits`."""

from __future__ import annotations

import copy

import torch

from ..adapters import ADAPTERS, Adapter, get_path
from ..edits import Edits
from . import absolute, alibi
from . import rotary as rot
from .rope import ROPE_SCHEMES, max_positions


def trained_window(config, params: dict) -> int:
    """The config's trained context: the scheme's original window if the model is already scaled natively,
    phi3's `original_max_position_embeddings`, else `max_position_embeddings`."""
    for value in (params.get("original_max_position_embeddings"), getattr(config, "original_max_position_embeddings", None)):
        if value:
            return int(value)
    return int(config.max_position_embeddings)


def apply_position(model, adapter: Adapter, req: dict, edits: Edits) -> None:
    if req["scheme"] in ROPE_SCHEMES:
        _apply_rope(model, adapter, req, edits)
    elif req["scheme"] == "interpolate":
        _apply_interpolate(model, adapter, req, edits)
    else:
        _replace_positions(model, adapter, req, edits)


def _apply_rope(model, adapter: Adapter, req: dict, edits: Edits) -> None:
    scheme = req["scheme"]
    config = model.config
    if not adapter.has_rope:
        rope_families = sorted(k for k, a in ADAPTERS.items() if a.has_rope)
        raise ValueError(
            f"position={scheme!r} is a RoPE scheme, but {adapter.model_type} has {adapter.position_kind()} absolute "
            f"position embeddings and no RoPE; RoPE schemes apply to: {', '.join(rope_families)}"
        )
    rotary = get_path(model.base_model, adapter.rotary)
    opts = {k: v for k, v in req.items() if k not in ("scheme", "layer_types", "original_max_position_embeddings")}
    info = ROPE_SCHEMES[scheme]
    original = config.rope_parameters
    all_types = rot.layer_types(config)

    # Which layer types the scheme applies to.
    if all_types == [None]:
        if "layer_types" in req:
            raise ValueError(f"layer_types= applies to models with per-layer-type RoPE (gemma3); {adapter.model_type} has one RoPE")
        targets = [None]
    else:
        targets = req.get("layer_types") or list(adapter.rope_layer_types) or all_types
        unknown = sorted(set(targets) - set(all_types))
        if unknown:
            raise ValueError(f"unknown layer_types {unknown}; this model's RoPE layer types: {sorted(all_types)}")
        if any(original[lt] is None for lt in targets):
            raise ValueError(f"layer types {[lt for lt in targets if original[lt] is None]} have no RoPE to scale")

    new_params = {}
    window = req.get("original_max_position_embeddings")
    for lt in targets:
        base = rot.params_of(config, lt)
        window = window or trained_window(config, base)
        n_freq = getattr(rotary, f"{rot._prefix(lt)}inv_freq").numel()  # rotated channels / 2
        for key in ("short_factor", "long_factor"):
            if key in opts and len(opts[key]) != n_freq:
                raise ValueError(
                    f"{key} must have one entry per rotary frequency: {n_freq} for this model "
                    f"(rotary dim {2 * n_freq}), got {len(opts[key])}"
                )
        new_params[lt] = info.build(base, window, opts, 2 * n_freq)
    rope_parameters = new_params[None] if targets == [None] else {**original, **new_params}
    n_positions = max_positions(scheme, window, opts)

    native = scheme != "dynamic-yarn" and all(p["rope_type"] in adapter.native_rope_types for p in new_params.values())
    edits.set(config, "max_position_embeddings", n_positions)
    if native:
        # The config describes the patch in transformers' own terms, so plain from_pretrained reloads it.
        edits.set(config, "rope_parameters", rope_parameters)
        if hasattr(config, "original_max_position_embeddings"):
            # phi3's standardization copies this attribute over rope_parameters' own value: keep them equal.
            edits.set(config, "original_max_position_embeddings", window)
        rope_config = config
    else:
        # The model's config keeps its original RoPE (its class cannot express this scheme); the rotary module
        # reads a private copy that does, and the hfpatch record carries the scheme through save/reload.
        rope_config = copy.copy(config)
        rope_config.rope_parameters = rope_parameters
        if hasattr(config, "original_max_position_embeddings"):
            rope_config.original_max_position_embeddings = window
        edits.set(rotary, "config", rope_config)
    rot.rebuild(rotary, rope_config, edits)
    if scheme == "dynamic-yarn":
        base = {lt: rot.params_of(config if native else rope_config, lt) for lt in targets}
        rot.make_dynamic_yarn(rotary, base, window, opts, edits)


def _replace_positions(model, adapter: Adapter, req: dict, edits: Edits) -> None:
    """alibi / nope / sinusoidal: take the model's own position signal out, then put the new one in."""
    scheme, config, base = req["scheme"], model.config, model.base_model
    if adapter.has_rope:  # RoPE becomes the identity: cos = 1, sin = 0 at every position
        rotary = get_path(base, adapter.rotary)
        edits.track_new_attributes(rotary)
        types = [lt for lt in rot.layer_types(config) if rot.params_of(config, lt) is not None]
        for lt in types:
            p = rot._prefix(lt)
            edits.set(rotary, f"{p}inv_freq", torch.zeros_like(getattr(rotary, f"{p}inv_freq")))
            edits.set(rotary, f"{p}original_inv_freq", torch.zeros_like(getattr(rotary, f"{p}inv_freq")))
            edits.set(rotary, f"{p}attention_scaling", 1.0)
            edits.delete(rotary, f"{p}long_inv_freq")
        # "default" keeps transformers' dynamic/longrope updates from recomputing the frequencies
        edits.set(rotary, "rope_type", "default" if types == [None] else {lt: "default" for lt in types})
    if adapter.position_table:
        table = get_path(base, adapter.position_table)
        lookup = absolute.SinusoidalPositions if scheme == "sinusoidal" else absolute.ZeroPositions
        edits.mix_in(table, lookup, under=True)
        if scheme == "sinusoidal":
            edits.set(table, "hfpatch_offset", adapter.position_offset)
    elif scheme == "sinusoidal":
        edits.mix_in(get_path(base, adapter.layers)[0], absolute.SinusoidalInput)
    if scheme == "alibi":
        slopes = torch.tensor(alibi.alibi_slopes(config.num_attention_heads, req.get("alibi_max_bias", 8.0)))
        for layer in get_path(base, adapter.layers):
            edits.set(get_path(layer, adapter.attention), alibi.SLOPES_ATTR, slopes)
        eager = config._attn_implementation == "eager"
        edits.set(config, "_attn_implementation_internal", alibi.EAGER_NAME if eager else alibi.SDPA_NAME)


def _apply_interpolate(model, adapter: Adapter, req: dict, edits: Edits) -> None:
    """A learned position table stretched to factor x its length by linear interpolation of its rows."""
    if not adapter.position_table:
        raise ValueError(
            f"position='interpolate' stretches a learned absolute position table; {adapter.model_type} has "
            f"{adapter.position_kind()} positions (for RoPE use linear, ntk, yarn, ...); it applies to: "
            f"{', '.join(sorted(k for k, a in ADAPTERS.items() if a.position_table))}"
        )
    base = model.base_model
    table = get_path(base, adapter.position_table)
    new = absolute.interpolate_rows(table.weight.detach(), req["factor"], keep=adapter.position_offset)
    n_positions = new.shape[0] - adapter.position_offset
    edits.set(table, "weight", torch.nn.Parameter(new, requires_grad=table.weight.requires_grad))
    edits.set(table, "num_embeddings", new.shape[0])
    edits.set(model.config, "max_position_embeddings", n_positions)
    # BERT keeps position_ids / token_type_ids buffers of the table's length
    owner = get_path(base, adapter.position_table.rpartition(".")[0]) if "." in adapter.position_table else base
    for name, fill in (("position_ids", "arange"), ("token_type_ids", "zeros")):
        buf = getattr(owner, "_buffers", {}).get(name)
        if buf is not None:
            grown = torch.arange(n_positions, dtype=buf.dtype, device=buf.device) if fill == "arange" else \
                torch.zeros(n_positions, dtype=buf.dtype, device=buf.device)
            edits.set(owner, name, grown.expand(*buf.shape[:-1], n_positions))
