"""patch / unpatch / describe: validate the request, apply it all-or-nothing, remember what was done.

The model is always `original ∘ spec`: a new request is merged into the current spec, every edit of the current
patch is undone, and the merged spec is applied from the original model. So a second position scheme replaces the
first instead of stacking on it, and repeating a spec is a no-op. If applying fails, the partial edits are undone
and the previous spec (if any) is applied again: the model is left as it was.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from transformers import PreTrainedModel

from . import spec as specs
from .adapters import ADAPTERS, Adapter, adapter_for, get_path
from .edits import Edits
from .norm import convert as norms
from .norm.placement import MIXINS, apply_placement
from .position import SCHEMES
from .position import rotary as rot
from .position.patch import apply_position
from .position.rope import ROPE_SCHEMES

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
        apply_position(model, adapter, spec["position"], edits)
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
