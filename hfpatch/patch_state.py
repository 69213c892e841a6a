"""What a patched model carries: the live PatchState on the model, the spec it was loaded with, the config values a
patch changed, and the position facts describe() and the save marks read. apply.py writes the state; everything else
reads it through these functions (hfpatch.apply re-exports them)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import cast

from transformers import PreTrainedModel

from . import spec as specs
from .adapters import Adapter, get_path
from .edits import Edits
from .position import registry as schemes
from .position.attention import paths
from .position.registry import SCHEMES

_STATE = "_hfpatch_state"  # attribute on the transformers model that holds the live PatchState
# attribute on the transformers model that holds the spec it was loaded with (from_pretrained, a GGUF's scaling):
# kept through unpatch and later patches, since it says where the model came from, not what it carries now
_LOADED = "_hfpatch_loaded_with"


@dataclass
class PatchState:
    spec: dict  # the live patch: undone by unpatch, replaced axis by axis by later patches
    layers: dict = field(default_factory=dict)  # {axis: Edits}, in application order (AXES)
    record: Edits = field(default_factory=Edits)  # writes config.hfpatch
    facts: dict = field(default_factory=dict)  # what applying found, per axis (e.g. {"norm": {"exact": False}})
    # Patches a checkpoint was saved with and that reloaded as part of the model (norm swaps change which weights
    # exist, so from_pretrained loads them already applied); unpatch keeps them. Their specs in the order they were
    # applied (a reloaded model can be patched on the same axis again), facts, and the original config values from
    # the saved record.
    baked_stages: list = field(default_factory=list)
    baked_facts: dict = field(default_factory=dict)
    baked_config: dict = field(default_factory=dict)
    config: Edits | None = None  # gave the model a config of its own (see own_config): undone last

    @property
    def baked(self) -> dict:
        """The baked stages as one spec (a later stage replaces an earlier one's axis)."""
        return {axis: req for stage in self.baked_stages for axis, req in stage.items()}

    @property
    def applied(self) -> dict:
        """What the model carries now: the baked spec with the live one over it."""
        return {**self.baked, **self.spec}


def unwrap(model) -> PreTrainedModel:
    """The transformers model to patch: itself, or the base model inside a peft.PeftModel."""
    target = model
    if not isinstance(target, PreTrainedModel) and hasattr(target, "get_base_model"):
        target = target.get_base_model()
    if not isinstance(target, PreTrainedModel):
        raise TypeError(
            "hfpatch patches a transformers PreTrainedModel (or a peft PeftModel around one), "
            f"got {type(model).__name__}"
        )
    return target


def state_of(model) -> PatchState | None:
    return getattr(unwrap(model), _STATE, None)



def set_state(target, state: PatchState | None) -> None:
    """Put `state` on the transformers model `target` (None: take its state off)."""
    if state is not None:
        object.__setattr__(target, _STATE, state)
    elif _STATE in vars(target):
        object.__delattr__(target, _STATE)



def mark_loaded(model) -> None:
    """Remember what `model` carries now as the patch it was loaded with (called by the loaders once the checkpoint's
    patch is applied again): describe() reports it, and the evaluations run `none` as the model so loaded."""
    target = unwrap(model)
    state = getattr(target, _STATE, None)
    object.__setattr__(target, _LOADED, copy.deepcopy(state.applied) if state and state.applied else None)


def loaded_with(model) -> dict | None:
    """The spec `model` was loaded with (baked stages and the patch applied again at load), None if it was loaded
    unpatched or not by hfpatch."""
    return copy.deepcopy(getattr(unwrap(model), _LOADED, None))


def unpatch_restores(model, state: PatchState | None) -> str:
    """What unpatch(model) gives, in words, for describe()."""
    baked = state.baked if state else {}
    keeps = f", keeping the weight-changing {specs.describe_string(baked)} it was saved with" if baked else ""
    if getattr(model, _LOADED, None):
        return "the checkpoint's base model" + keeps
    return "the model as it was before patch()" + keeps



def sub_configs(config) -> list[tuple[str, object]]:
    """[(prefix, config)]: the config and its sub-configs (a multimodal model's text_config, ...), keys prefixed
    "text_config." so that a record names where each value lives."""
    out = [("", config)]
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict") and all(sub is not c for _, c in out):
            out.append((name + ".", sub))
    return out


def touched_config(config, logs) -> dict:
    """{config attribute ("text_config.x" for a sub-config's): value before the first of `logs` (in order)
    changed it}."""
    out: dict = {}
    for prefix, c in sub_configs(config):
        for edits in logs:
            for k, v in edits.touched(c).items():
                out.setdefault(prefix + k, v)
    out.pop("hfpatch", None)
    return out



# ---------------------------------------------------------------------------------------------------------------
# what the model carries, for describe() and the save marks

def position_facts(model, adapter: Adapter, state: PatchState | None) -> dict:
    config = model.config.get_text_config()
    applied = state.applied if state else {}
    if "position" in applied:
        req = applied["position"]
        if SCHEMES[req["scheme"]].rope is None:  # a bigger table is still a plain checkpoint; the others are not
            chosen = {**state.baked_facts, **state.facts}.get("position", {}) if state else {}
            return {**req, **chosen, "native": SCHEMES[req["scheme"]].native, **paths.describe(model, req["scheme"])}
        rotary = get_path(model.base_model, adapter.rotary)
        # no config class names per-layer positions: a model with them reloads patched through hfpatch only
        return {**req, "rope_parameters": copy.deepcopy(rotary.config.rope_parameters),
                "native": rotary.config is config and "layers" not in req}
    if adapter.has_rope:
        params = get_path(model.base_model, adapter.rotary).config.rope_parameters
        flat = "rope_type" in params
        rope_type = params["rope_type"] if flat else {lt: p and p["rope_type"] for lt, p in params.items()}
        scheme = schemes.from_rope_type(cast(str, rope_type)) if flat else "rope"
        return {"scheme": scheme, "rope_parameters": copy.deepcopy(params), "native": True}
    if adapter.position_table:
        return {"scheme": "learned", "table": adapter.position_table}
    return {"scheme": adapter.position_signal}


def applied_spec(applied: dict, facts: dict) -> dict:
    """The applied spec as describe() reports it: a norm swap's `exact` is whether the conversion was exact (the
    fact, also in describe()["norm"]), not whether it was asked for: exact=True on a model where the math allows no
    exact conversion gives a plain swap."""
    out = copy.deepcopy(applied)
    if "norm" in out and "exact" in facts.get("norm", {}):
        out["norm"]["exact"] = facts["norm"]["exact"]
    return out
