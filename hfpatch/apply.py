"""patch / unpatch: validate the request, apply it all-or-nothing, remember what was done.

The model is `original ∘ norm ∘ placement ∘ position ∘ temperature`, each axis applied with its own log of edits.
A new request is merged into the current spec; the first axis (in that order) whose request changed and every axis
after it are undone and applied again, the axes before it are kept as they are (with their weights, trained or not).
So a second position scheme replaces the first instead of stacking on it, repeating a spec is a no-op, and a position
patch after a norm swap keeps the norm weights a healing run trained. If applying fails, the partial edits are undone
and the undone ones are put back (the same objects): the model is left exactly as it was.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import torch
from transformers import PreTrainedConfig, PreTrainedModel

from . import spec as specs
from .adapters import Adapter, adapter_for, get_path
from .edits import MISSING, Edits, deferred_interrupts
from .norm import convert as norms
from .norm import fit
from .norm import kinds as norm_kinds
from .norm.kinds import NORMS
from .norm.placement import PLACEMENTS, apply_placement
from .patch_state import (
    PatchState,
    applied_spec,
    loaded_with,
    mark_loaded,
    position_facts,
    set_state,
    state_of,
    sub_configs,
    touched_config,
    unpatch_restores,
    unwrap,
)
from .position import layers
from .position import registry as schemes
from .position.attention import paths
from .position.attention import temperature as temperatures
from .position.registry import LAYER_SCHEMES, SCHEMES
from .save_marks import (
    NEEDS_HFPATCH,
    bind_save,
    config_path,
    marked_for_plain_reload,
    save_marked,
    serializable,
    unexpressed,
)
from .spec import AXES
from .utils.warn import warn_caller

__all__ = [  # patch / unpatch and what the package reads of a patched model (patch_state, save_marks) from one place
    "AXES", "RECORD_VERSION", "PatchRefused", "PatchState", "unwrap", "state_of", "changes_weights", "apply_axes",
    "sub_configs", "touched_config", "block_names", "patch", "own_config", "unpatch", "mark_loaded", "loaded_with",
    "unpatch_restores", "calibrate", "bake", "serializable", "unexpressed", "NEEDS_HFPATCH", "marked_for_plain_reload",
    "config_path", "save_marked", "position_facts", "applied_spec", "get_path",
]

RECORD_VERSION = 2  # 2: the record carries the adapter (1: without it)
# patch / unpatch return the object they were given: a transformers model, or a peft model around one
ModelT = TypeVar("ModelT", bound=torch.nn.Module)


class PatchRefused(ValueError):
    """A patch that could not be applied to this model: an error inside applying it (not in the request) becomes
    this refusal, which names the family and the step, after the model was put back exactly as it was."""

def changes_weights(axis: str, req: dict) -> bool:
    """Whether a patch changes which weights exist (or their shapes): such patches reload by loading the saved
    weights into the patched structure (io.from_pretrained); the others are simply applied again."""
    return (axis == "norm" or (axis == "placement" and PLACEMENTS[req["kind"]].changes_weights)
            or (axis == "position" and SCHEMES[req["scheme"]].changes_weights))


# ---------------------------------------------------------------------------------------------------------------
# patch / unpatch


def _apply_axis(model: PreTrainedModel, adapter: Adapter, axis: str, req: dict, edits: Edits) -> dict | None:
    if axis == "norm":
        reason = norm_kinds.unavailable(req["kind"], model, adapter)
        if reason:
            raise ValueError(reason)
        return norms.apply_norm(model, adapter, req, NORMS[req["kind"]], adapter.placement_of(model.config), edits)
    if axis == "placement":
        return apply_placement(model, adapter, req, edits)
    if axis == "temperature":
        return temperatures.apply_temperature(model, adapter, req, edits)  # the values it chose for options left out
    scheme = SCHEMES[req["scheme"]]
    reason = schemes.unavailable(req["scheme"], adapter, req)
    if reason:
        raise ValueError(reason)
    fact = scheme.apply(model, adapter, req, scheme, edits)  # None, or the values it chose for options left out
    if "layers" in req:  # per-layer positions change what the rotary module just rebuilt hands some layers
        fact = {**(fact or {}), **layers.apply_layers(model, adapter, req, LAYER_SCHEMES, edits)}
    return fact


def apply_axes(model: PreTrainedModel, adapter: Adapter, spec: dict, layers: dict,
               axes: Iterable[str] = AXES) -> dict:
    """Apply the named axes of `spec`, each into a new Edits stored in `layers` (before it runs, so that a failure
    half-way can still be undone). Returns the facts."""
    facts = {}
    for axis in axes:
        if axis in spec:
            layers[axis] = Edits()
            fact = _apply_axis(model, adapter, axis, spec[axis], layers[axis])
            if fact is not None:
                facts[axis] = fact
    return facts



def _write_record(model, state: PatchState, record: Edits) -> None:
    """The record that save_pretrained writes (model.save_pretrained too, as part of the config): the spec, the
    order of the stages it was applied in, and the config values the patch replaced, so that from_pretrained can
    rebuild the original first."""
    live = touched_config(model.config, [state.layers[a] for a in AXES if a in state.layers])
    touched = {**live, **state.baked_config}  # the values before the baked stages are the originals
    stages = state.baked_stages + ([state.spec] if state.spec else [])
    facts = {**state.baked_facts, **state.facts}
    record.set(model.config, "hfpatch", _record(applied_spec(state.applied, facts), touched, facts, stages,
                                                adapter_for(model).to_dict(model.config)))
    for owner, names in block_names(model).items():
        record.set(owner, "_no_split_modules", names)
    bind_save(model, record)


def block_names(model: torch.nn.Module) -> dict:
    """{each PreTrainedModel in `model` whose _no_split_modules must change: the names it should hold}.
    transformers (device_map) and accelerate (FSDP's transformer-based wrapping) find the blocks to keep whole by
    class name; a patch that gives blocks a subclass (post-norm placement, the sinusoidal input of layer 0) would hide
    them, so each listed name is followed to the classes in the model that subclass it."""
    classes = {type(m) for m in model.modules()}
    out = {}
    for owner in model.modules():
        names = owner.__dict__.get("_no_split_modules") if isinstance(owner, PreTrainedModel) else None
        if not names:
            continue
        now = set()
        for name in names:
            now |= {c.__name__ for c in classes if any(b.__name__ == name for b in c.__mro__)} or {name}
        if now != set(names):
            out[owner] = now
    return out


def _record(spec: dict, touched: dict, facts: dict, stages: list, adapter: dict) -> dict:
    return {
        "version": RECORD_VERSION,
        "spec": copy.deepcopy(spec),
        "stages": copy.deepcopy(stages),
        "facts": copy.deepcopy(facts),
        "original_config": {k: copy.deepcopy(v) for k, v in touched.items() if v is not MISSING and k != "hfpatch"},
        "added_config": sorted(k for k, v in touched.items() if v is MISSING and k != "hfpatch"),
        "adapter": adapter,
    }


def patch(model: ModelT, position: str | None = None, factor: float | None = None, norm: str | None = None,
          placement: str | None = None, exact: bool | None = None,
          attention_temperature: str | dict[str, Any] | None = None, **options: Any) -> ModelT:
    """Patch `model` in place and return it: its position encoding, its norms, their placement, or several at once.

    The patch replaces what was patched on the same axis before (a second `position=` replaces the first, never
    stacks on it) and is all or nothing: bad input or a failure leaves the model exactly as it was. `unpatch`
    undoes it. Every scheme and the options it takes: [Patch options](options.md).

    Args:
        model: a transformers causal LM (or a peft model wrapping one).
        position: the position scheme, e.g. `"yarn"`, `"ntk"`, `"linear"`, `"dynamic"`, `"llama3"`, `"longrope"`,
            `"self-extend"`, `"dual-chunk"`, `"alibi"`, `"nope"`, `"sinusoidal"`, `"t5"`, `"xl"`, `"learned"`,
            `"interpolate"`, `"rope"`, `"p-rope"`.
        factor: the context extension ratio (> 1), for the schemes that take one.
        norm: `"rmsnorm"`, `"layernorm"`, `"batchnorm"` or `"dyt"`: the kind every norm becomes.
        placement: `"pre"`, `"post"`, `"peri"` or `"mix"`: where the norms sit in each block.
        exact: with `norm`, whether to convert function-preservingly where the math allows (default True).
        attention_temperature: `"logn"` or `"llama4"` (or `{"kind": ..., option: value}`): a query scale that
            grows with position past the trained window, on top of any position scheme.
        **options: the scheme's own options, e.g. `beta_fast=` (YaRN), `group_size=` and `window=` (Self-Extend),
            `chunk_size=` (Dual Chunk Attention), `keep=` (p-RoPE), `post_fraction=` (Mix-LN),
            `original_max_position_embeddings=`; with a RoPE scheme, `layers=` gives some layers `nope` or `p-rope`
            (`layers={"nope": "every4"}`: layers 3, 7, 11, ...;
            [Per-layer positions](../patching/positions.md#per-layer-positions)).

    Returns:
        The same `model` object, patched.

    Raises:
        ValueError: an unknown scheme or option, a value out of range, or a patch that does not apply to this
            model (the message says why and what is accepted).
        TypeError: an option of the wrong type.
    """
    target = unwrap(model)
    request = specs.request(position=position, factor=factor, norm=norm, placement=placement, exact=exact,
                            attention_temperature=attention_temperature, **options)
    old: PatchState = state_of(target) or PatchState(spec={})
    new_spec = specs.merge(old.spec, request)
    if new_spec == old.spec:
        return model
    adapter = adapter_for(target)  # after validating the request: bad input costs no probe forward
    first = next(i for i, a in enumerate(AXES) if new_spec.get(a) != old.spec.get(a))
    redo = AXES[first:]
    for a in redo:
        if a in old.spec and new_spec.get(a) == old.spec[a] and changes_weights(a, old.spec[a]):
            warn_caller(f"{a}={specs.describe_string({a: old.spec[a]})!r} is applied again from the weights it "
                        f"replaced, because {AXES[first]} (applied before it) changed: training done since on the "
                        "weights it created is lost")
    with deferred_interrupts(), _outside_inference_mode(target):
        _replace(target, adapter, old, new_spec, redo)
    return model


def _outside_inference_mode(model) -> contextlib.AbstractContextManager:
    """Under torch.inference_mode(), tensors created are inference tensors, which autograd refuses for good (and
    in-place updates refuse outside inference mode): parameters and buffers a patch creates there would make the
    model fail as soon as it trains. So a patch made under inference mode creates them outside it, unless the
    model's own parameters are inference tensors already (a model built under inference mode, for inference).
    Buffers do not tell: a rotary module run under inference mode recomputes its own."""
    if not torch.is_inference_mode_enabled():
        return contextlib.nullcontext()
    return torch.inference_mode(any(p.is_inference() for p in model.parameters()))


def _replace(target: PreTrainedModel, adapter: Adapter, old: PatchState, new_spec: dict, redo: tuple) -> None:
    """Undo the axes in `redo` (newest first), apply them as `new_spec` says, record it and make it the live state;
    on any exception, put everything back as it was (the previous patch's own objects, trained weights included)."""
    previous = state_of(target)
    undone = [old.record] + [old.layers[a] for a in reversed(redo) if a in old.layers]
    new = PatchState(spec=new_spec, layers={a: e for a, e in old.layers.items() if a not in redo},
                     facts={a: f for a, f in old.facts.items() if a not in redo}, config=old.config,
                     **{k: getattr(old, k) for k in ("baked_stages", "baked_facts", "baked_config")})
    started: list[Edits] = []
    try:
        if new.config is None:
            new.config = Edits()
            own_config(target, new.config)
        for edits in undone:
            started.append(edits)
            edits.undo()
        new.facts.update(apply_axes(target, adapter, new_spec, new.layers, redo))
        _write_record(target, new, new.record)
        set_state(target, new)
        if "position" in redo:  # describe()'s calls per attention path count from this patch on, its checks not
            paths.reset(target)
    except BaseException as e:
        set_state(target, previous)
        new.record.undo()
        for a in reversed(redo):
            if a in new.layers:
                new.layers[a].undo()
        for edits in reversed(started):
            edits.redo()
        if new.config is not None and new.config is not old.config:  # (old.config is new.config when None)
            new.config.undo()
        if isinstance(e, (ValueError, TypeError)) or not isinstance(e, Exception):
            raise  # a refusal with its reason already, or an interrupt: as it is
        step = next((a for a in reversed(redo) if a in new.layers and a in new_spec), None) \
            or next(a for a in redo if a in new_spec)
        raise PatchRefused(f"hfpatch could not apply {specs.describe_string({step: new_spec[step]})!r} to this "
                           f"{adapter.model_type} model ({type(e).__name__}: {' '.join(str(e).split())[:300]}); "
                           "the model is unchanged") from e



def own_config(model: PreTrainedModel, edits: Edits) -> None:
    """Give the model a copy of its config (and sub-configs) of its own, in every module that holds one, so that a
    patch never writes into a config object that another model also holds (`from_config(a.config)` shares it).
    Undoing `edits` gives the original objects back."""
    memo: dict = {}  # id(original object) -> its copy, for the config and everything inside it
    copy.deepcopy(model.config, memo)
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, PreTrainedConfig) and id(value) in memo:
                edits.set(module, name, memo[id(value)])


def unpatch(model: ModelT) -> ModelT:
    """Undo every patch: the original modules, buffers, classes and config values come back themselves.

    A model loaded patched (`hfpatch.from_pretrained` of a folder saved patched, a GGUF file with RoPE scaling) goes
    back to the checkpoint's base model: the patch it was loaded with is undone too (`describe()["loaded_with"]`
    names it; patch the model with it again to get the loaded model back). Patches a checkpoint was saved with that
    changed which weights exist (`describe()["baked"]`) are part of the reloaded model and stay. Atomic: after an
    exception or an interrupt the model is still patched, exactly as before the call.

    Args:
        model: a model patched by `patch` (an unpatched model is returned as it is).

    Returns:
        The same `model` object: as it was before its first patch, or the checkpoint's base model.
    """
    target = unwrap(model)
    state = state_of(target)
    if state is None:
        return model
    logs = [state.record] + [state.layers[a] for a in reversed(AXES) if a in state.layers]
    logs += [state.config] if state.config is not None else []
    with deferred_interrupts():
        started: list[Edits] = []
        try:
            for edits in logs:
                started.append(edits)
                edits.undo()
            set_state(target, None)
            if state.baked_stages:
                bake(target, state.baked_stages, state.baked_facts, state.baked_config)
        except BaseException:
            for edits in reversed(started):
                edits.redo()
            set_state(target, state)
            raise
    return model



def calibrate(model: torch.nn.Module,
              batches: torch.Tensor | Mapping[str, torch.Tensor]
              | Iterable[torch.Tensor | Mapping[str, torch.Tensor]] | None = None) -> int:
    """Fit what a patch put in `model` to the model it replaced (norm/fit.py).

    Fits the running statistics of `norm="batchnorm"`, the α of each `norm="dyt"` module, and the scale and bias of
    `placement="peri"`'s output norms.

    Args:
        model: a model patched with `norm="batchnorm"`, `norm="dyt"` or `placement="peri"`.
        batches: token ids `[batch, seq]`, a tokenizer's output, or a list of those; None: a seeded batch of
            random tokens.

    Returns:
        The number of norms calibrated.

    Raises:
        ValueError: the model has nothing to calibrate.
    """
    return fit.calibrate(unwrap(model), batches)  # (peft's adapters sit inside the base model)


def bake(model: PreTrainedModel, stages: list, facts: dict, original_config: dict) -> None:
    """Declare the specs `stages` (applied in that order) part of the model as it is now (used by from_pretrained
    after loading weights that already carry those patches)."""
    state = PatchState(spec={}, baked_stages=copy.deepcopy(stages), baked_facts=facts, baked_config=original_config)
    model.config.hfpatch = _record(applied_spec(state.baked, facts), original_config, facts, stages,
                                   adapter_for(model).to_dict(model.config))
    set_state(model, state)
    bind_save(model, None)
