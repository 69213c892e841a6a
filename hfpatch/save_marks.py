"""What a patched model's folder says to the loaders that read it: the mark that sends a plain transformers load to
the original architecture, the original values of the config fields a non-native scheme changed, the GGUF quantizer
detached for the save, and a patched model's own save_pretrained that writes all this (hfpatch.apply re-exports
these)."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

from transformers import PreTrainedModel

from .adapters import adapter_for
from .edits import MISSING, Edits
from .norm import convert as norms
from .patch_state import position_facts, state_of, touched_config, unwrap


@contextlib.contextmanager
def serializable(model) -> Iterator[None]:
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
def marked_for_plain_reload(model, unexpressed: list) -> Iterator[None]:
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


def config_path(config, key: str) -> tuple[Any, str]:
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


def _own_save_pretrained(self, save_directory, *args, **kwargs) -> None:
    """A patched model's own `save_pretrained` (bound to it while it carries a patch): whatever calls it —
    transformers.Trainer's checkpoints and save_model, TRL's trainers, push_to_hub — writes the folder that
    hfpatch.save_pretrained writes, whose config.json a plain loader reads as the original model or warns about."""
    if args:  # transformers' save_pretrained takes everything after the folder by keyword
        raise TypeError(f"save_pretrained takes one positional argument (the folder), got {1 + len(args)}")
    return save_marked(self, save_directory, **kwargs)


def bind_save(model: PreTrainedModel, edits: Edits | None) -> None:
    """Make `model.save_pretrained` go through save_marked: through `edits` (undone by unpatch), or for good."""
    bound = types.MethodType(_own_save_pretrained, model)  # deepcopy rebinds a bound method to the copy
    if edits is None:
        object.__setattr__(model, "save_pretrained", bound)
    else:
        edits.set(model, "save_pretrained", bound)
