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
import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import transformers
import yaml
from transformers import AutoConfig, AutoModelForCausalLM

from .. import spec as specs
from ..adapters import Adapter, adapter_for, set_adapter
from ..apply import (
    AXES,
    NEEDS_HFPATCH,
    apply_axes,
    bake,
    changes_weights,
    config_path,
    mark_loaded,
    patch,
    save_marked,
    touched_config,
    unexpressed,
    unwrap,
)
from ..introspect import describe
from ..utils.files import cached_sha256, write_file
from ..utils.warn import warn_caller
from .serving import serving_keys

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel


def save_pretrained(model: PreTrainedModel, path: Path | str, tokenizer: Any = None, **kwargs: Any) -> Path | str:
    """Save a model, patched or not, so that `from_pretrained` rebuilds it with its patches.

    Writes the weights, the config (with an "hfpatch" section recording the patches) and the tokenizer if given.
    Native RoPE schemes also reload in plain transformers.

    Args:
        model: a transformers causal LM, patched or not.
        path: the folder to write.
        tokenizer: saved into the same folder when given.
        **kwargs: passed to transformers' `save_pretrained`.

    Returns:
        `path`, as given.

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
    plain = unexpressed(target)
    if plain:
        warnings.warn(
            f"{' and '.join(f'{axis}={name!r}' for axis, name, _ in plain)} "
            f"{'has' if len(plain) == 1 else 'have'} no form that {type(target.config).__name__} can express: "
            "hfpatch.from_pretrained reloads the patch, plain transformers loads the model's original "
            f"{' and '.join(what for _, _, what in plain)}, and warns that it does (config.json names "
            "hfpatch as its quantization method, which transformers does not know)",
            stacklevel=2,
        )
    with _serving_keys(target):  # the serving engines' own keys, where they read RoPE otherwise
        save_marked(target, path, **kwargs)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    if kwargs.get("is_main_process", True):
        write_card(target, path)
    return path


# The part of README.md that hfpatch writes: between these markers, replaced on every save; the rest is the user's.
CARD_START, CARD_END = "<!-- hfpatch:start -->", "<!-- hfpatch:end -->"
# The evaluations `hfpatch card` adds (hfpatch.evaluate.card): their section, the folder of their plots, and the
# line in the section naming the model files they are of (dropped with its plots by a save that changes them).
RESULTS_START, RESULTS_END = "<!-- hfpatch:results:start -->", "<!-- hfpatch:results:end -->"
PLOTS = "hfpatch-evaluations"
_RESULTS_MODEL = "<!-- hfpatch:results:model "


def write_card(model: PreTrainedModel, path: Path | str) -> None:
    """README.md in `path`: a model card with Hub metadata (front matter) and an hfpatch section saying what the
    patch is and how to load it. A card already there keeps its text and front matter keys: the section between
    the markers is replaced (or appended) and hfpatch's tags are added; its evaluations (`hfpatch card`) stay if
    they are of the model files now in `path`, else they and their plots are removed, with a warning. Written whole
    (a temporary file renamed)."""
    info = describe(model)
    readme = os.path.join(path, "README.md")
    old = ""
    if os.path.isfile(readme):
        with open(readme, encoding="utf-8") as f:
            old = f.read()
    front, body = _split_front_matter(old)
    front.setdefault("library_name", "transformers")
    base = model.config.name_or_path
    base = str(base) if base and os.path.abspath(base) != os.path.abspath(path) else None  # not this folder
    if base and not is_local(base):  # the Hub's base_model is a hub id; a folder is named in the section only
        front.setdefault("base_model", base)
    tags = list(front.get("tags") or [])
    front["tags"] = tags + [t for t in ["hfpatch", *_scheme_names(info["applied"])] if t not in tags]
    stale = RESULTS_START in body and RESULTS_END in body and not results_hold(body, path)
    if stale:
        body = without_section(body, RESULTS_START, RESULTS_END)
    meta = yaml.safe_dump(front, sort_keys=False, allow_unicode=True)
    card = f"---\n{meta}---\n{with_section(body, _section(model, info, base))}"
    write_file(readme, lambda tmp: tmp.write_text(card, encoding="utf-8"))
    if stale:
        shutil.rmtree(os.path.join(path, PLOTS), ignore_errors=True)
        warn_caller("the model card's evaluations (added by hfpatch card) are of other model files than the ones "
                    "this save wrote: they are removed from the card, with their plots; hfpatch card DIR --results "
                    "RUN_DIR adds evaluations of this model")


def is_local(name: str) -> bool:
    """Whether a model's name (as loaded: config.name_or_path, the --model of an evaluation) is a path on this
    machine rather than a hub id: absolute, starting with . or ~, or present here."""
    return os.path.isabs(os.path.expanduser(name)) or name.startswith((".", "~")) or os.path.exists(name)


def public_name(name: str) -> str:
    """How a card, which is published, names a model: a hub id (or "smollm2") as given; a local folder or file by
    its own name, never by its path on this machine."""
    if not is_local(name):
        return name
    return os.path.basename(os.path.abspath(os.path.expanduser(name))) or name


def results_model_line(fingerprint: dict[str, str]) -> str:
    """The line of the card's evaluations section that names the model files the evaluations are of ({file: SHA-256},
    as hfpatch.models.model_fingerprint gives them for a folder): their names and one digest of them all."""
    record = {"files": sorted(fingerprint), "sha256": _digest(fingerprint)}
    return f"{_RESULTS_MODEL}{json.dumps(record)} -->"


def _digest(fingerprint: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(fingerprint.items())).encode()).hexdigest()


def results_hold(body: str, folder: Path | str) -> bool:
    """Whether the evaluations section of a card's text is of the model files now in `folder`: the files its model
    line names, hashed again, give its digest (a section without that line holds for no model)."""
    section = body.split(RESULTS_START, 1)[1].split(RESULTS_END, 1)[0]
    line = next((x for x in section.splitlines() if x.startswith(_RESULTS_MODEL) and x.endswith("-->")), None)
    if line is None:
        return False
    try:
        record = json.loads(line[len(_RESULTS_MODEL):-3])
        names, digest = record["files"], record["sha256"]
        files = [os.path.join(folder, n) for n in names]
    except (ValueError, KeyError, TypeError):  # a line edited out of shape
        return False
    if not names or not all(os.path.isfile(f) for f in files):
        return False
    return _digest({n: cached_sha256(f) for n, f in zip(names, files, strict=True)}) == digest


def without_section(body: str, start: str, end: str) -> str:
    """`body` without the section between the markers `start` and `end` (markers included)."""
    before, rest = body.split(start, 1)
    after = rest.split(end, 1)[1].lstrip("\n")
    return before.rstrip("\n") + "\n" + ("\n" + after if after else "")


def _split_front_matter(text: str) -> tuple[dict, str]:
    if text.startswith("---\n") and "\n---\n" in text[3:]:
        head, body = text[4:].split("\n---\n", 1)
        front = yaml.safe_load(head) or {}
        if isinstance(front, dict):
            return front, body
    return {}, text


def with_section(body: str, section: str, start: str = CARD_START, end: str = CARD_END) -> str:
    """`body` with the section between the markers `start` and `end` replaced by `section` (appended where the
    markers are not there yet); the rest of the text kept."""
    block = f"{start}\n{section}{end}\n"
    if start in body and end in body:
        before, rest = body.split(start, 1)
        return before + block + rest.split(end, 1)[1].lstrip("\n")
    return (body.rstrip("\n") + "\n\n" if body.strip() else "") + block


def _scheme_names(applied: dict) -> list[str]:
    """The names of what was applied on each axis (yarn, rmsnorm, post, logn)."""
    return [str(req.get("scheme") or req.get("kind")) for req in applied.values() if isinstance(req, dict)]


def _section(model: PreTrainedModel, info: dict, base: str | None) -> str:
    applied = info["applied"]
    spec = specs.describe_string(applied) if applied else "none"
    native = not unexpressed(model)
    record = getattr(model.config, "hfpatch", None) or {}
    rope = info["position"].get("rope_parameters") or {}
    trained = (record.get("original_config", {}).get("max_position_embeddings")
               or rope.get("original_max_position_embeddings") or info["max_position_embeddings"])
    extended = info["position_limit"] or info["max_position_embeddings"]
    if native:
        load = ("from transformers import AutoModelForCausalLM\n"
                "model = AutoModelForCausalLM.from_pretrained(\"PATH\")  # the patch is native: plain transformers")
    else:
        load = ("import hfpatch\n"
                "model = hfpatch.from_pretrained(\"PATH\")  # plain transformers would build the unpatched model")
    return ("## Patched with hfpatch\n\n"
            + (f"- Base model: `{public_name(base)}`\n" if base else "")
            + f"- Patch: `{spec}`\n"
            f"- Trained window: {trained} tokens; extended window: {extended or 'unbounded'}"
            f"{' tokens' if extended else ''}\n"
            f"- Loads patched in plain transformers: {'yes' if native else 'no, use hfpatch.from_pretrained'}\n\n"
            f"```python\n{load}\n```\n\n")


def _drop_mark(config: PreTrainedConfig) -> None:
    qc = getattr(config, "quantization_config", None)
    if isinstance(qc, dict) and qc.get("quant_method") == NEEDS_HFPATCH:
        del config.quantization_config


def _model_class(config: PreTrainedConfig) -> Any:
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return AutoModelForCausalLM



def from_pretrained(path: Path | str, **kwargs: Any) -> PreTrainedModel:
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
    config = _read_config(path, kwargs)
    _drop_mark(config)
    record = getattr(config, "hfpatch", None)
    if record is None:
        return _model_class(config).from_pretrained(path, config=config, **kwargs)
    if not isinstance(record, dict) or record.get("version") not in (1, 2):
        raise ValueError(f"{path}: unreadable hfpatch section in config.json (expected version 1 or 2): {record!r}")
    _restore_original_config(config, record)
    spec = record["spec"]
    # Weight-changing patches of every stage (a reloaded model patched again on the same axis saves two stages),
    # in the order they were applied; the other axes of the final spec are applied again after loading.
    stages = _weight_stages(record.get("stages", [spec]))
    live = {k: v for k, v in spec.items() if not changes_weights(k, v)}
    if not stages:
        model = _model_class(config).from_pretrained(path, config=config, **kwargs)
        if "adapter" in record:
            set_adapter(model, Adapter.from_dict(record["adapter"]))
        return _loaded(patch(model, **specs.to_kwargs(live)))
    model = _load_into_patched_structure(path, config, record, stages, kwargs)
    return _loaded(patch(model, **specs.to_kwargs(live)) if live else model)


def _weight_stages(stages: list[dict]) -> list[dict]:
    """The weight-changing part of each saved stage, in order, less a placement that a later stage replaces: a
    placement applied to a reloaded model gives the blocks their own form first, so the saved weights hold only the
    last one's (peri's output norms are gone from them once another placement replaced it)."""
    out = []
    for i, stage in enumerate(stages):
        replaced = any("placement" in later for later in stages[i + 1:])
        kept = {k: v for k, v in stage.items() if changes_weights(k, v) and not (k == "placement" and replaced)}
        if kept:
            out.append(kept)
    return out


def _read_config(path: str | Path, kwargs: dict) -> PreTrainedConfig:
    """The folder's config, read with the loading settings among `kwargs`; remote code refused in one line."""
    config_kwargs = {k: kwargs[k] for k in ("trust_remote_code", "revision", "token", "gguf_file") if k in kwargs}
    try:
        return AutoConfig.from_pretrained(path, **config_kwargs)
    except ValueError as e:
        if "trust_remote_code" not in str(e) or kwargs["trust_remote_code"]:
            raise
        raise ValueError(remote_code_refused(path, "from_pretrained(..., trust_remote_code=True)")) from None


def _restore_original_config(config: PreTrainedConfig, record: dict) -> None:
    """Put back in `config` the values the saved patch replaced, take out the ones it added, and drop the record."""
    for key, value in record.get("original_config", {}).items():
        owner, name = config_path(config, key)
        setattr(owner, name, value)
    for key in record.get("added_config", []):
        owner, name = config_path(config, key)
        if name in owner.__dict__:
            delattr(owner, name)
    del config.hfpatch


def _load_into_patched_structure(path: str | Path, config: PreTrainedConfig, record: dict, stages: list,
                                 kwargs: dict) -> PreTrainedModel:
    """The checkpoint loaded into a model that already carries its weight-changing `stages` (baked into it)."""
    # transformers builds the model through a subclass whose __init__ applies those patches (by the same code that
    # patched the saved model), then loads the checkpoint into it with its own loader (key renames, tied weights,
    # dtype, device_map), so every saved tensor finds its place.
    cls = _model_class(config)
    # The structure is read before any weight exists (transformers builds the model on the meta device): from the
    # adapter the record carries, or, for records written before it did, from a replica built on the CPU.
    adapter = Adapter.from_dict(record["adapter"]) if "adapter" in record else adapter_for(cls(config))
    built: dict = {}

    def __init__(self, config, *args, **kw) -> None:
        cls.__init__(self, config, *args, **kw)
        set_adapter(self, adapter)
        facts, logs = {}, []
        with warnings.catch_warnings():  # the plain-swap warning was given when the patch was made
            warnings.simplefilter("ignore")
            for stage in stages:
                layers: dict = {}
                facts.update(apply_axes(self, adapter, stage, layers))
                logs += [layers[a] for a in AXES if a in layers]
        built["facts"], built["config"] = facts, touched_config(self.config, logs)

    structured = cast("type[PreTrainedModel]",
                      type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__}))
    model = structured.from_pretrained(path, config=config, **kwargs)
    model.__class__ = cls
    set_adapter(model, adapter)
    # The reloaded structure is the model now: unpatch cannot bring back weights that are not in the folder.
    bake(model, stages, built["facts"], built["config"])
    return model


def _loaded(model: PreTrainedModel) -> PreTrainedModel:
    """The model, with the patch it now carries remembered as the one it was loaded with (describe())."""
    mark_loaded(model)
    return model


_PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")
_SAFE = ("model.safetensors", "model.safetensors.index.json")


def refuse_pickled_weights(path: Path | str, use_safetensors: bool | None, opt_in: str) -> None:
    """A local folder whose weights are pickles only, loaded with use_safetensors=True: one clear error (transformers'
    own says only that model.safetensors is missing)."""
    if use_safetensors is not True or not os.path.isdir(path):
        return
    names = set(os.listdir(path))
    if names & set(_PICKLED) and not names & set(_SAFE):
        raise ValueError(f"{path} holds its weights as pickles ({', '.join(sorted(names & set(_PICKLED)))}), which "
                         f"hfpatch does not load unless asked: {opt_in} (they are then read with torch.load("
                         "weights_only=True)), or convert them to safetensors")


def remote_code_refused(path: Path | str, opt_in: str) -> str:
    return (f"{path} needs the Python code it carries (auto_map in its config) to be run, which hfpatch does not do "
            f"unless asked: {opt_in}, after reading that code")


@contextlib.contextmanager
def _serving_keys(model) -> Iterator[None]:
    """The saved config carries the serving engines' own keys where they read the RoPE otherwise than transformers
    (serving.serving_keys: LongRoPE's attention factor as vLLM and SGLang read it); the live config is left as it
    was."""
    config = model.config.get_text_config()
    extra = serving_keys(config)  # {} for a config without RoPE, or whose engines read it as transformers does
    if not extra:
        yield
        return
    before = config.rope_parameters
    config.rope_parameters = {**before, **extra}
    try:
        yield
    finally:
        config.rope_parameters = before
