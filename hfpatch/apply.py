"""patch / unpatch / describe: validate the request, apply it all-or-nothing, remember what was done.

The model is always `original ∘ spec`: a new request is merged into the current spec, every edit of the current
patch is undone, and the merged spec is applied from the original model. So a second position scheme replaces the
first instead of stacking on it, and repeating a spec is a no-op. If applying fails, the partial edits are undone
and the previous spec (if any) is applied again: the model is left as it was.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from . import spec as specs
from .adapters import ADAPTERS, Adapter, adapter_for, get_path
from .edits import Edits
from .norm import convert as norms
from .norm.placement import MIXINS, apply_placement
from .position import SCHEMES
from .position import absolute as absolute
from .position import alibi as alibi
from .position import rotary as rot
from .position.rope import ROPE_SCHEMES, max_positions

RECORD_VERSION = 1
_STATE = "_hfpatch_state"  # attribute on the transformers model that holds the live PatchState


@dataclass
class PatchState:
    spec: dict  # the live patch: undone by unpatch, replaced axis by axis by later patches
    edits: Edits = field(default_factory=Edits)
    facts: dict = field(default_factory=dict)  # what applying found, per axis (e.g. {"norm": {"exact": False}})
    # Axes a checkpoint was saved with and that reloaded as part of the model (norm swaps change which weights
    # exist, so from_pretrained loads them already applied); unpatch keeps them. Their spec, facts and the
    # original config values from the saved record.
    baked: dict = field(default_factory=dict)
    baked_facts: dict = field(default_factory=dict)
    baked_config: dict = field(default_factory=dict)


def unwrap(model) -> PreTrainedModel:
    """The transformers model to patch: itself, or the base model inside a peft.PeftModel."""
    target = model
    if not isinstance(target, PreTrainedModel) and hasattr(target, "get_base_model"):
        target = target.get_base_model()
    if not isinstance(target, PreTrainedModel):
        raise TypeError(
            f"hfpatch patches a transformers PreTrainedModel (or a peft PeftModel around one), got {type(model).__name__}"
        )
    return target


def state_of(model) -> PatchState | None:
    return getattr(unwrap(model), _STATE, None)


# ---------------------------------------------------------------------------------------------------------------
# position


def _trained_window(config, params: dict) -> int:
    """The config's trained context: the scheme's original window if the model is already scaled natively,
    phi3's `original_max_position_embeddings`, else `max_position_embeddings`."""
    for value in (params.get("original_max_position_embeddings"), getattr(config, "original_max_position_embeddings", None)):
        if value:
            return int(value)
    return int(config.max_position_embeddings)


def _apply_position(model: PreTrainedModel, adapter: Adapter, req: dict, edits: Edits) -> None:
    if req["scheme"] in ROPE_SCHEMES:
        _apply_rope(model, adapter, req, edits)
    elif req["scheme"] == "interpolate":
        _apply_interpolate(model, adapter, req, edits)
    else:
        _replace_positions(model, adapter, req, edits)


def _apply_rope(model: PreTrainedModel, adapter: Adapter, req: dict, edits: Edits) -> None:
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
        window = window or _trained_window(config, base)
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


def _replace_positions(model: PreTrainedModel, adapter: Adapter, req: dict, edits: Edits) -> None:
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


def _apply_interpolate(model: PreTrainedModel, adapter: Adapter, req: dict, edits: Edits) -> None:
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


def changes_weights(axis: str, req: dict) -> bool:
    """Whether a patch changes which weights exist (or their shapes): such patches reload by loading the saved
    weights into the patched structure (io.from_pretrained); the others are simply applied again."""
    return axis == "norm" or (axis == "position" and req["scheme"] == "interpolate")


# ---------------------------------------------------------------------------------------------------------------
# patch / unpatch


def _apply(model: PreTrainedModel, adapter: Adapter, spec: dict, edits: Edits, state: PatchState | None) -> dict:
    """Apply a whole spec to the (original or baked) model; returns the facts. Norms first: the exact conversion
    needs the blocks as they were built; placement next; position last."""
    facts = {}
    if "norm" in spec:
        facts["norm"] = norms.apply_norm(model, adapter, spec["norm"], adapter.placement_of(model.config), edits)
    if "placement" in spec:
        facts["placement"] = apply_placement(model, adapter, spec["placement"], edits)
    if "position" in spec:
        _apply_position(model, adapter, spec["position"], edits)
    # The record that save_pretrained writes (and that model.save_pretrained writes too, as part of the config):
    # the spec, and the config values the patch replaced, so that from_pretrained can rebuild the original first.
    baked = state.baked if state else {}
    touched = {**(state.baked_config if state else {}), **edits.touched(model.config)}
    all_facts = {**(state.baked_facts if state else {}), **facts}
    edits.set(model.config, "hfpatch", _record({**baked, **spec}, touched, all_facts))
    return facts


def _record(spec: dict, touched: dict, facts: dict) -> dict:
    from .edits import _MISSING

    return {
        "version": RECORD_VERSION,
        "spec": copy.deepcopy(spec),
        "facts": copy.deepcopy(facts),
        "original_config": {k: copy.deepcopy(v) for k, v in touched.items() if v is not _MISSING and k != "hfpatch"},
        "added_config": sorted(k for k, v in touched.items() if v is _MISSING and k != "hfpatch"),
    }


def patch(model, position=None, factor=None, norm=None, placement=None, exact=None, **options):
    """Patch `model` in place (and return it). See the README for every scheme and option."""
    target = unwrap(model)
    adapter = adapter_for(target.config)
    request = specs.request(position=position, factor=factor, norm=norm, placement=placement, exact=exact, **options)
    state: PatchState | None = getattr(target, _STATE, None)
    current = state.spec if state else {}
    new = specs.merge(current, request)
    if new == current:
        return model
    if state:
        state.edits.undo()
    edits = Edits()
    try:
        facts = _apply(target, adapter, new, edits, state)
    except BaseException:
        edits.undo()
        if state:  # put the previous patch back; it applied cleanly before
            _apply(target, adapter, current, state.edits, state)
        raise
    kept = {k: getattr(state, k) for k in ("baked", "baked_facts", "baked_config")} if state else {}
    object.__setattr__(target, _STATE, PatchState(spec=new, edits=edits, facts=facts, **kept))
    return model


def unpatch(model):
    """Undo every patch: the original modules, buffers, classes and config values come back themselves. Axes that
    a checkpoint was saved with (see PatchState.baked) are part of the reloaded model and stay."""
    target = unwrap(model)
    state = getattr(target, _STATE, None)
    if state is not None:
        state.edits.undo()
        object.__delattr__(target, _STATE)
        if state.baked:
            bake(target, state.baked, state.baked_facts, state.baked_config)
    return model


def bake(model, spec: dict, facts: dict, original_config: dict) -> None:
    """Declare `spec` part of the model as it is now (used by from_pretrained after loading weights that already
    carry those patches)."""
    state = PatchState(spec={}, baked=spec, baked_facts=facts, baked_config=original_config)
    model.config.hfpatch = _record(spec, original_config, facts)
    object.__setattr__(model, _STATE, state)


# ---------------------------------------------------------------------------------------------------------------
# describe / supported

_RT_TO_SCHEME = {"default": "rope", "linear": "linear", "dynamic": "dynamic", "yarn": "yarn", "llama3": "llama3",
                 "longrope": "longrope"}


def _position(model, adapter: Adapter, state: PatchState | None) -> dict:
    config = model.config
    applied = {**state.baked, **state.spec} if state else {}
    if "position" in applied:
        req = applied["position"]
        if req["scheme"] not in ROPE_SCHEMES:  # a bigger table is still a plain checkpoint; the others are not
            return {**req, "native": req["scheme"] == "interpolate"}
        rotary = get_path(model.base_model, adapter.rotary)
        return {**req, "rope_parameters": copy.deepcopy(rotary.config.rope_parameters),
                "native": rotary.config is config}
    if adapter.has_rope:
        params = config.rope_parameters
        flat = rot.layer_types(config) == [None]
        rope_type = params["rope_type"] if flat else {lt: p and p["rope_type"] for lt, p in params.items()}
        scheme = _RT_TO_SCHEME.get(rope_type, rope_type) if flat else "rope"
        return {"scheme": scheme, "rope_parameters": copy.deepcopy(params), "native": True}
    if adapter.position_table:
        return {"scheme": "learned", "table": adapter.position_table}
    return {"scheme": "none"}


UNBOUNDED_SCHEMES = ("alibi", "nope", "sinusoidal", "dynamic", "dynamic-yarn")


def position_limit(model) -> int | None:
    """The longest sequence the model's position encoding is meant for now: a learned table's rows, RoPE's
    (scaled) max_position_embeddings; None for schemes without a fixed window (ALiBi, NoPE, sinusoidal, dynamic
    scaling)."""
    target = unwrap(model)
    adapter = adapter_for(target.config)
    state = getattr(target, _STATE, None)
    applied = {**state.baked, **state.spec} if state else {}
    scheme = applied.get("position", {}).get("scheme")
    if scheme in UNBOUNDED_SCHEMES:
        return None
    if adapter.position_table:
        return get_path(target.base_model, adapter.position_table).num_embeddings - adapter.position_offset
    return int(target.config.max_position_embeddings)


def describe(model) -> dict:
    """What the model is, how it normalizes and encodes position now, and what hfpatch has applied."""
    target = unwrap(model)
    adapter = adapter_for(target.config)
    state = getattr(target, _STATE, None)
    applied = {**state.baked, **state.spec} if state else {}
    facts = {**state.baked_facts, **state.facts} if state else {}
    norm = {"kind": norms.current_kind(target, adapter),
            "scale": "1 + weight" if adapter.norm_offset else "weight"}
    if "norm" in applied:
        norm.update(facts.get("norm", {}))
    return {
        "family": adapter.model_type,
        "class": type(target).__name__,
        "norm": norm,
        "placement": applied.get("placement", {}).get("kind") or adapter.placement_of(target.config),
        "position": _position(target, adapter, state),
        "attention": target.config._attn_implementation,
        "max_position_embeddings": target.config.max_position_embeddings,
        "position_limit": position_limit(target),
        "applied": copy.deepcopy(applied),
        "baked": sorted(state.baked) if state else [],
        "patches": _available(adapter),
    }


def _available(adapter: Adapter) -> dict:
    return {
        "position": [s for s in SCHEMES if (s in ROPE_SCHEMES and adapter.has_rope)
                     or (s == "interpolate" and adapter.position_table) or s in ("alibi", "nope", "sinusoidal")],
        "norm": list(specs.NORMS),
        "exact_layernorm_to_rmsnorm": bool(adapter.residual_readers) and adapter.placement != "post",
        "placement": sorted({want for (layout, want) in MIXINS if layout == adapter.placement_layout}
                            | ({adapter.placement} if isinstance(adapter.placement, str) and adapter.placement_layout else set())),
    }


def supported() -> dict:
    """{family: {norm, placement, position, patches}} for every family with an adapter."""
    return {
        name: {
            "norm": a.norm,
            "placement": a.placement if isinstance(a.placement, str) else "per-config",
            "position": a.position_kind(),
            "causal": a.causal,
            "patches": _available(a),
        }
        for name, a in sorted(ADAPTERS.items())
    }
