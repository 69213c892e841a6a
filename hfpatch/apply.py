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
import types
from dataclasses import dataclass, field
from typing import cast

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
from .position import layers
from .position import registry as schemes
from .position.attention import paths
from .position.attention import temperature as temperatures
from .position.registry import LAYER_SCHEMES, SCHEMES
from .spec import AXES
from .utils.warn import warn_caller

RECORD_VERSION = 2  # 2: the record carries the adapter (1: without it)


class PatchRefused(ValueError):
    """A patch that could not be applied to this model: an error inside applying it (not in the request) becomes
    this refusal, which names the family and the step, after the model was put back exactly as it was."""
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


def changes_weights(axis: str, req: dict) -> bool:
    """Whether a patch changes which weights exist (or their shapes): such patches reload by loading the saved
    weights into the patched structure (io.from_pretrained); the others are simply applied again."""
    return (axis == "norm" or (axis == "placement" and PLACEMENTS[req["kind"]].changes_weights)
            or (axis == "position" and SCHEMES[req["scheme"]].changes_weights))


# ---------------------------------------------------------------------------------------------------------------
# patch / unpatch


def _apply_axis(model: PreTrainedModel, adapter: Adapter, axis: str, req: dict, edits: Edits):
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


def apply_axes(model: PreTrainedModel, adapter: Adapter, spec: dict, layers: dict, axes=AXES) -> dict:
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
    _bind_save(model, record)


def block_names(model) -> dict:
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


def patch(model, position=None, factor=None, norm=None, placement=None, exact=None, attention_temperature=None,
          **options):
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
    old: PatchState = getattr(target, _STATE, None) or PatchState(spec={})
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
    previous = getattr(target, _STATE, None)
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
        object.__setattr__(target, _STATE, new)
        if "position" in redo:  # describe()'s calls per attention path count from this patch on, its checks not
            paths.reset(target)
    except BaseException as e:
        _set_state(target, previous)
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


def _set_state(target, state: PatchState | None) -> None:
    if state is not None:
        object.__setattr__(target, _STATE, state)
    elif _STATE in vars(target):
        object.__delattr__(target, _STATE)


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


def unpatch(model):
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
    state = getattr(target, _STATE, None)
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
            object.__delattr__(target, _STATE)
            if state.baked_stages:
                bake(target, state.baked_stages, state.baked_facts, state.baked_config)
        except BaseException:
            for edits in reversed(started):
                edits.redo()
            object.__setattr__(target, _STATE, state)
            raise
    return model


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


def calibrate(model, batches=None) -> int:
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


def bake(model, stages: list, facts: dict, original_config: dict) -> None:
    """Declare the specs `stages` (applied in that order) part of the model as it is now (used by from_pretrained
    after loading weights that already carry those patches)."""
    state = PatchState(spec={}, baked_stages=copy.deepcopy(stages), baked_facts=facts, baked_config=original_config)
    model.config.hfpatch = _record(applied_spec(state.baked, facts), original_config, facts, stages,
                                   adapter_for(model).to_dict(model.config))
    object.__setattr__(model, _STATE, state)
    _bind_save(model, None)


# ---------------------------------------------------------------------------------------------------------------
# saving: what a patched model's folder says to the loaders that read it


@contextlib.contextmanager
def serializable(model):
    """Let transformers save a model loaded from GGUF.

    A GGUF checkpoint loaded by transformers' dequantizing loader holds plain float weights but keeps its quantizer,
    whose `is_serializable()` is False, and a `quantization_config` that would make the saved folder look like a
    GGUF file to the next loader. Both are detached for the duration of the save.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    if quantizer is None or str(getattr(method, "value", method)) != "gguf":
        yield
        return
    packed = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.lower().startswith("gguf")})
    if packed:
        raise ValueError(
            f"this GGUF model keeps its weights packed ({', '.join(packed)}); load it dequantized to save it "
            "(from_pretrained(..., gguf_file=..., quantization_config=GgufConfig(dequantize=True)))"
        )
    config = model.config
    had_qc = "quantization_config" in config.__dict__
    qc = config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None
    try:
        yield
    finally:
        model.hf_quantizer = quantizer
        if had_qc:
            config.quantization_config = qc


def unexpressed(model) -> list[tuple[str, str, str]]:
    """(axis, what was applied, what plain transformers builds instead) for each patch of `model` that its config
    class cannot express: a norm swap or a placement change (the family's class builds its own norms, where they
    were), a position scheme without a native form."""
    state = state_of(model)
    if state is None:
        return []
    target, adapter = unwrap(model), adapter_for(model)
    applied, out = state.applied, []
    if "norm" in applied and norms.current_kind(target, adapter) != adapter.norm:
        out.append(("norm", applied["norm"]["kind"], "norms"))
    if "placement" in applied and applied["placement"]["kind"] != adapter.placement_of(model.config):
        out.append(("placement", applied["placement"]["kind"], "norm placement"))
    if "position" in applied and not position_facts(target, adapter, state).get("native", True):
        out.append(("position", applied["position"]["scheme"], "position encoding"))
    if "temperature" in applied:  # no config class names one (Llama 4's is its own, for its NoPE layers)
        out.append(("attention_temperature", applied["temperature"]["kind"], "attention (without the temperature)"))
    return out


# What config.json carries when plain transformers cannot express the patch it was saved with: a quantization
# config whose method is this sentence. transformers knows no such method, so its from_pretrained logs "Unknown
# quantization type, got <this sentence>" and loads the original architecture (it has no hook that would let a
# config refuse to load without running the folder's code); engines that read quantization_config refuse the
# folder. hfpatch.from_pretrained removes it before loading.
NEEDS_HFPATCH = ("hfpatch (saved patched by hfpatch, in a form this config class cannot express: load it with "
                 "hfpatch.from_pretrained; plain transformers builds the original, unpatched architecture)")


@contextlib.contextmanager
def marked_for_plain_reload(model, unexpressed: list):
    """While saving a model with patches plain transformers cannot express: config.json names NEEDS_HFPATCH as its
    quantization method (where the model has no quantization config of its own), and holds the original values of
    the config fields a non-native position scheme changed (the record keeps the patched ones), so that a plain
    reload builds the original model consistently: its own window, not the patched one's."""
    edits = Edits()
    config = model.config
    if unexpressed and getattr(config, "quantization_config", None) is None:
        edits.set(config, "quantization_config", {"quant_method": NEEDS_HFPATCH})
    state = state_of(model)
    if state is not None and any(axis == "position" for axis, _, _ in unexpressed) and "position" in state.layers:
        for key, value in touched_config(config, [state.layers["position"]]).items():
            owner, name = config_path(config, key)
            if not name.startswith("_") and value is not MISSING:
                edits.set(owner, name, value)
    try:
        yield
    finally:
        edits.undo()


def config_path(config, key: str):
    """(the config or sub-config holding `key`, the attribute name): "text_config.max_position_embeddings"."""
    *subs, name = key.split(".")
    for sub in subs:
        config = getattr(config, sub)
    return config, name


def save_marked(model: PreTrainedModel, path, **kwargs) -> None:
    """transformers' own save of `model`, with what its folder must say to a plain loader (`marked_for_plain_reload`)
    and without what would stop a GGUF-loaded model from saving (`serializable`)."""
    with serializable(model), marked_for_plain_reload(model, unexpressed(model)):
        type(model).save_pretrained(model, path, **kwargs)


def _own_save_pretrained(self, save_directory, *args, **kwargs):
    """A patched model's own `save_pretrained` (bound to it while it carries a patch): whatever calls it —
    transformers.Trainer's checkpoints and save_model, TRL's trainers, push_to_hub — writes the folder that
    hfpatch.save_pretrained writes, whose config.json a plain loader reads as the original model or warns about."""
    if args:  # transformers' save_pretrained takes everything after the folder by keyword
        raise TypeError(f"save_pretrained takes one positional argument (the folder), got {1 + len(args)}")
    return save_marked(self, save_directory, **kwargs)


def _bind_save(model: PreTrainedModel, edits: Edits | None) -> None:
    """Make `model.save_pretrained` go through save_marked: through `edits` (undone by unpatch), or for good."""
    bound = types.MethodType(_own_save_pretrained, model)  # deepcopy rebinds a bound method to the copy
    if edits is None:
        object.__setattr__(model, "save_pretrained", bound)
    else:
        edits.set(model, "save_pretrained", bound)


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
