"""Saving and reloading patched models.

`save_pretrained` writes what `model.save_pretrained` writes; the config carries an "hfpatch" section (the spec and
the config values the patch replaced). RoPE patches that transformers can express are also in the config's own
`rope_parameters`, so plain `AutoModelForCausalLM.from_pretrained` reloads them; the others (dynamic-yarn, or a
scheme the family's config class refuses, e.g. yarn on phi3) reload through `hfpatch.from_pretrained` only.

`from_pretrained` restores the original config values, lets transformers build and load the original model, and
applies the recorded spec again.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from .. import spec as specs
from ..adapters import Adapter, adapter_for, set_adapter
from ..apply import (
    AXES,
    apply_axes,
    bake,
    changes_weights,
    describe,
    mark_loaded,
    patch,
    state_of,
    touched_config,
    unwrap,
)
from ..edits import MISSING, Edits


@contextlib.contextmanager
def _serializable(model):
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


def save_pretrained(model, path, tokenizer=None, **kwargs):
    """Save a model, patched or not, so that `from_pretrained` rebuilds it with its patches.

    Writes the weights, the config (with an "hfpatch" section recording the patches) and the tokenizer if given.
    Native RoPE schemes also reload in plain transformers.

    Args:
        model: a transformers causal LM, patched or not.
        path: the folder to write.
        tokenizer: saved into the same folder when given.
        **kwargs: passed to transformers' `save_pretrained`.

    Raises:
        ValueError: `path` is a file, or the model carries peft adapters (merge them first).
    """
    if os.path.isfile(path):  # transformers only logs this and returns
        raise ValueError(f"{path} is a file, not a folder: save_pretrained writes a folder")
    target = unwrap(model)
    tuned = sorted({name.rsplit(".", 1)[-1] for name, m in target.named_modules()
                    if type(m).__module__.startswith("peft.") and hasattr(m, "base_layer")})
    if tuned:  # their weights would be saved under base_layer/lora_* names that a plain model does not load
        raise ValueError(
            f"the model carries peft adapters (on {', '.join(tuned)}); merge them first "
            "(model = model.merge_and_unload(), then hfpatch.save_pretrained), or save the adapters alone with "
            "peft's model.save_pretrained"
        )
    unexpressed = _unexpressed(target)
    if unexpressed:
        warnings.warn(
            f"{' and '.join(f'{axis}={name!r}' for axis, name, _ in unexpressed)} "
            f"{'has' if len(unexpressed) == 1 else 'have'} no form that {type(target.config).__name__} can express: "
            "hfpatch.from_pretrained reloads the patch, plain transformers loads the model's original "
            f"{' and '.join(what for _, _, what in unexpressed)}, and warns that it does (config.json names "
            "hfpatch as its quantization method, which transformers does not know)",
            stacklevel=2,
        )
    with _serializable(target), _marked(target, unexpressed):
        target.save_pretrained(path, **kwargs)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def _unexpressed(model) -> list[tuple[str, str, str]]:
    """(axis, what was applied, what plain transformers builds instead) for each patch of `model` that its config
    class cannot express: a norm swap or a placement change (the family's class builds its own norms, where they
    were), a position scheme without a native form."""
    state = state_of(model)
    if state is None:
        return []
    info, adapter = describe(model), adapter_for(model)
    applied, out = info["applied"], []
    if "norm" in applied and info["norm"]["kind"] != adapter.norm:
        out.append(("norm", applied["norm"]["kind"], "norms"))
    if "placement" in applied and applied["placement"]["kind"] != adapter.placement_of(model.config):
        out.append(("placement", applied["placement"]["kind"], "norm placement"))
    if "position" in applied and not info["position"].get("native", True):
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
def _marked(model, unexpressed: list):
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
            owner, name = _config_path(config, key)
            if not name.startswith("_") and value is not MISSING:
                edits.set(owner, name, value)
    try:
        yield
    finally:
        edits.undo()


def _drop_mark(config) -> None:
    qc = getattr(config, "quantization_config", None)
    if isinstance(qc, dict) and qc.get("quant_method") == NEEDS_HFPATCH:
        del config.quantization_config


def _model_class(config):
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return AutoModelForCausalLM



def _config_path(config, key: str):
    """(the config or sub-config holding `key`, the attribute name): "text_config.max_position_embeddings"."""
    *subs, name = key.split(".")
    for sub in subs:
        config = getattr(config, sub)
    return config, name


def from_pretrained(path, **kwargs):
    """Rebuild a model saved by `save_pretrained`, patched or not, with its patches applied.

    Two defaults differ from transformers': `trust_remote_code=False` (the Python code a model folder may carry is
    never run unless asked, and never asked for at a prompt) and `use_safetensors=True` (pickled
    `pytorch_model.bin` weights are refused; `use_safetensors=None` reads them, with
    `torch.load(weights_only=True)`).

    Args:
        path: a folder written by `save_pretrained` (or any transformers model folder or hub id).
        **kwargs: passed to transformers' `from_pretrained` (`dtype=`, `device_map=`, `gguf_file=`, ...).

    Returns:
        The model, with the same logits as when it was saved.

    Raises:
        ValueError: pickled weights without `use_safetensors=None`, or a folder that is not a model.
    """
    kwargs = {"trust_remote_code": False, **kwargs}
    if not kwargs.get("gguf_file"):
        kwargs.setdefault("use_safetensors", True)
        refuse_pickled_weights(path, kwargs["use_safetensors"], "from_pretrained(..., use_safetensors=None)")
    config_kwargs = {k: kwargs[k] for k in ("trust_remote_code", "revision", "token", "gguf_file") if k in kwargs}
    try:
        config = AutoConfig.from_pretrained(path, **config_kwargs)
    except ValueError as e:
        if "trust_remote_code" not in str(e) or kwargs["trust_remote_code"]:
            raise
        raise ValueError(remote_code_refused(path, "from_pretrained(..., trust_remote_code=True)")) from None
    _drop_mark(config)
    record = getattr(config, "hfpatch", None)
    if record is None:
        return _model_class(config).from_pretrained(path, config=config, **kwargs)
    if not isinstance(record, dict) or record.get("version") not in (1, 2):
        raise ValueError(f"{path}: unreadable hfpatch section in config.json (expected version 1 or 2): {record!r}")
    for key, value in record.get("original_config", {}).items():
        owner, name = _config_path(config, key)
        setattr(owner, name, value)
    for key in record.get("added_config", []):
        owner, name = _config_path(config, key)
        if name in owner.__dict__:
            delattr(owner, name)
    del config.hfpatch
    spec = record["spec"]
    # Weight-changing patches of every stage (a reloaded model patched again on the same axis saves two stages),
    # in the order they were applied; the other axes of the final spec are applied again after loading.
    stages = [{k: v for k, v in stage.items() if changes_weights(k, v)} for stage in record.get("stages", [spec])]
    stages = [stage for stage in stages if stage]
    live = {k: v for k, v in spec.items() if not changes_weights(k, v)}
    if not stages:
        model = _model_class(config).from_pretrained(path, config=config, **kwargs)
        if "adapter" in record:
            set_adapter(model, Adapter.from_dict(record["adapter"]))
        return _loaded(patch(model, **specs.to_kwargs(live)))
    # transformers builds the model through a subclass whose __init__ applies those patches (by the same code that
    # patched the saved model), then loads the checkpoint into it with its own loader (key renames, tied weights,
    # dtype, device_map), so every saved tensor finds its place.
    cls = _model_class(config)
    # The structure is read before any weight exists (transformers builds the model on the meta device): from the
    # adapter the record carries, or, for records written before it did, from a replica built on the CPU.
    adapter = Adapter.from_dict(record["adapter"]) if "adapter" in record else adapter_for(cls(config))
    built = {}

    def __init__(self, config, *args, **kw):
        cls.__init__(self, config, *args, **kw)
        set_adapter(self, adapter)
        facts, logs = {}, []
        with warnings.catch_warnings():  # the plain-swap warning was given when the patch was made
            warnings.simplefilter("ignore")
            for stage in stages:
                layers = {}
                facts.update(apply_axes(self, adapter, stage, layers))
                logs += [layers[a] for a in AXES if a in layers]
        built["facts"], built["config"] = facts, touched_config(self.config, logs)

    structured = type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__})
    model = structured.from_pretrained(path, config=config, **kwargs)
    model.__class__ = cls
    set_adapter(model, adapter)
    # The reloaded structure is the model now: unpatch cannot bring back weights that are not in the folder.
    bake(model, stages, built["facts"], built["config"])
    return _loaded(patch(model, **specs.to_kwargs(live)) if live else model)


def _loaded(model):
    """The model, with the patch it now carries remembered as the one it was loaded with (describe())."""
    mark_loaded(model)
    return model


_PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")
_SAFE = ("model.safetensors", "model.safetensors.index.json")


def refuse_pickled_weights(path, use_safetensors, opt_in: str) -> None:
    """A local folder whose weights are pickles only, loaded with use_safetensors=True: one clear error (transformers'
    own says only that model.safetensors is missing)."""
    if use_safetensors is not True or not os.path.isdir(path):
        return
    names = set(os.listdir(path))
    if names & set(_PICKLED) and not names & set(_SAFE):
        raise ValueError(f"{path} holds its weights as pickles ({', '.join(sorted(names & set(_PICKLED)))}), which "
                         f"hfpatch does not load unless asked: {opt_in} (they are then read with torch.load("
                         "weights_only=True)), or convert them to safetensors")


def remote_code_refused(path, opt_in: str) -> str:
    return (f"{path} needs the Python code it carries (auto_map in its config) to be run, which hfpatch does not do "
            f"unless asked: {opt_in}, after reading that code")
