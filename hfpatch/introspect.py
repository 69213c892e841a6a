"""What a model is and what applies to it: describe() (family, norm, placement, position and its parameters, the
attention path counts, what was applied and what the model was loaded with), the length limits the evaluations and
recipes read, and what `patch` accepts here with the reasons for the rest (supported() reads it for every family).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import spec as specs
from .adapters import Adapter, InferenceError, adapter_for, get_path
from .apply import applied_spec, loaded_with, position_facts, state_of, unpatch_restores, unwrap
from .norm import convert as norms
from .norm import kinds as norm_kinds
from .norm.kinds import NORMS
from .norm.placement import PLACEMENTS, placement_forms
from .position import layers
from .position import registry as schemes
from .position.attention import temperature as temperatures
from .position.attention.temperature import TEMPERATURES
from .position.registry import LAYER_SCHEMES, SCHEMES

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _limit_kind(model: PreTrainedModel, adapter: Adapter) -> str | None:
    """What kind of length limit the model has now (position/registry.py, `limit`): that of the position scheme
    applied, else "table" for a model's own learned table, "window" for the others."""
    state = state_of(model)
    scheme = (state.applied if state else {}).get("position", {}).get("scheme")
    if scheme is not None:
        return SCHEMES[scheme].limit
    return "table" if adapter.position_table else "window"


def position_limit(model: PreTrainedModel) -> int | None:
    """The longest sequence the model's position encoding is meant for now: a learned table's rows, RoPE's
    (scaled) max_position_embeddings; None for schemes without a fixed window (ALiBi, NoPE, sinusoidal, dynamic
    scaling)."""
    target = unwrap(model)
    adapter = adapter_for(target)
    if _limit_kind(target, adapter) is None:
        return None
    if adapter.position_table:
        return get_path(target.base_model, adapter.position_table).num_embeddings - adapter.position_offset
    return int(target.config.get_text_config().max_position_embeddings)


def table_limit(model: Any) -> int | None:
    """The hard length limit of a model that reads a learned position table (its own, interpolated or not, or
    position='learned'): past it the model fails with an index error deep inside, so evaluations and studies refuse
    such lengths. None otherwise: RoPE only degrades past its window (that is what the evaluations measure), and
    ALiBi / NoPE / sinusoidal no longer read the table. None also for a family hfpatch cannot read (it is scored
    unpatched; its limits are its own)."""
    target = unwrap(model)
    try:
        adapter = adapter_for(target)
    except InferenceError:
        return None
    return position_limit(target) if _limit_kind(target, adapter) == "table" else None


def describe(model: PreTrainedModel) -> dict:
    """What the model is, how it normalizes and encodes position now, and what hfpatch has applied.

    Args:
        model: a transformers causal LM, patched or not.

    Returns:
        A dict: `family`, `class`, `norm` (kind, scale, after a norm patch whether it was exact), `placement`,
        `position` (the scheme and its parameters), `position_layers` (with per-layer positions: the scheme of every
        block, None for a block without attention), `attention`, `max_position_embeddings`, `position_limit`,
        `applied` (the patch spec), `baked` (patches a reloaded checkpoint carries), `adapter` (what hfpatch read
        off the model, with notes) and `patches` (what else `patch` accepts here, and why the rest does not apply;
        `exact_layernorm_to_rmsnorm` is None on a model without LayerNorms).
        `loaded_with` is the patch the model was loaded with ("yarn:4"; None when it was loaded unpatched) and
        `unpatch_restores` says what `unpatch` gives back: for a model loaded patched, the checkpoint's base model
        (the loaded patch undone too; weight-changing patches it was saved with stay, see `baked`).
    """
    target = unwrap(model)
    adapter = adapter_for(target)
    state = state_of(target)
    applied = state.applied if state else {}
    facts = {**state.baked_facts, **state.facts} if state else {}
    norm = {"kind": norms.current_kind(target, adapter),
            "scale": "1 + weight" if adapter.norm_offset else "weight"}
    upcasts = {c.upcast for c in adapter.norm_classes.values()}
    if len(upcasts) == 1 and None not in upcasts:  # how the family's own norms round in bfloat16
        norm["bf16"] = {"fp32": "computed in float32, rounded once", "normalize": "normalized in float32, scaled "
                        "in the input dtype", "none": "computed in the input dtype"}[upcasts.pop()]
    if "norm" in applied:
        norm.update(facts.get("norm", {}))
    return {
        "family": adapter.model_type,
        "class": type(target).__name__,
        "norm": norm,
        "placement": applied.get("placement", {}).get("kind") or adapter.placement_of(target.config),
        **({"placement_layers": facts["placement"]["layers"]} if "layers" in facts.get("placement", {}) else {}),
        "position": position_facts(target, adapter, state),
        **({"position_layers": facts["position"]["by_layer"]} if "by_layer" in facts.get("position", {}) else {}),
        "attention_temperature": _temperature(applied, facts),
        "attention": target.config._attn_implementation,
        "max_position_embeddings": target.config.get_text_config().max_position_embeddings,
        "position_limit": position_limit(target),
        "applied": applied_spec(applied, facts),
        "baked": sorted(state.baked) if state else [],
        "loaded_with": specs.describe_string(loaded) if (loaded := loaded_with(target)) else None,
        "unpatch_restores": unpatch_restores(target, state),
        "adapter": {"source": adapter.source, "notes": dict(adapter.notes)},
        "patches": available(target, adapter),
    }


def _temperature(applied: dict, facts: dict) -> dict | None:
    """The attention temperature applied, with the values it chose for options left out; None: none."""
    if "temperature" not in applied:
        return None
    return {**applied["temperature"], **facts.get("temperature", {})}


# the norm kinds (convert.current_kind) of a model without a LayerNorm, for which exact_layernorm_to_rmsnorm is None
NO_LAYERNORM = ("rmsnorm", "none")


def available(model: PreTrainedModel, adapter: Adapter) -> dict:
    """What `patch` accepts for this model, per axis, and why the rest does not apply."""
    why = {f"position={s}": schemes.unavailable(s, adapter) for s in SCHEMES}
    norm_why = {f"norm={k}": norm_kinds.unavailable(k, model, adapter) for k in NORMS}
    offered = [k for k in NORMS if norm_why[f"norm={k}"] is None]
    # one reason for the axis where no kind applies, else one per kind that does not
    why.update(norm_why if offered else {"norm": next(iter(norm_why.values()))})
    exact = norms.exact_blocker(model, adapter, adapter.placement_of(model.config))
    # the question only arises where there is a LayerNorm to convert: an RMSNorm model's answer is None (null), not
    # a "true" that reads as if the model had LayerNorms
    has_layernorm = norms.current_kind(model, adapter) not in NO_LAYERNORM
    why["exact_layernorm_to_rmsnorm"] = exact if has_layernorm else None
    forms = placement_forms(adapter)
    if len(forms) < 2:
        why["placement"] = adapter.notes.get("placement") or "the blocks have no known pre/post form"
    else:
        why.update({f"placement={k}": f"{adapter.model_type}'s blocks have no {k} form hfpatch knows"
                    for k in PLACEMENTS if k not in forms})
    why["position_layers"] = layers.unavailable(model, adapter)
    why.update({f"attention_temperature={k}": temperatures.unavailable(k, adapter) for k in TEMPERATURES})
    return {
        "position": [s for s in SCHEMES if why[f"position={s}"] is None],
        # per-layer positions (layers= of a RoPE scheme): the schemes some layers can be given
        "position_layers": [] if why["position_layers"] else list(LAYER_SCHEMES),
        "attention_temperature": [k for k in TEMPERATURES if why[f"attention_temperature={k}"] is None],
        "norm": offered,
        "exact_layernorm_to_rmsnorm": exact is None if has_layernorm else None,
        "placement": forms,
        "not_available": {k: v for k, v in why.items() if v},
    }


def summary(model: PreTrainedModel, adapter: Adapter) -> dict:
    """What the model is and what patch accepts for it (hfpatch.supported of one model)."""
    return {
        "norm": adapter.norm,
        "placement": adapter.placement_of(model.config),
        "position": adapter.position_signal,
        "causal": adapter.causal,
        "adapter": {"source": adapter.source, "notes": dict(adapter.notes)},
        "patches": available(model, adapter),
    }
