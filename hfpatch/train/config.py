"""Recipe configs: a YAML file, then `key=value` overrides from the command line (dotted keys reach into sections,
values are parsed as YAML: `lr=3e-4`, `data.text_files=[a.txt,b.txt]`, `patch.position=yarn`).

Every key is checked against the recipe's schema before anything is loaded: an unknown key, a wrong type or a
missing data path is one clear error (ConfigError), never ignored.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import math
import os
import re
from collections.abc import Hashable
from pathlib import Path

import yaml
from accelerate.tracking import get_available_trackers
from accelerate.utils import LoggerType
from huggingface_hub.errors import StrictDataclassError
from transformers import CONFIG_MAPPING

from .. import spec
from .init import INITS


class ConfigError(ValueError):
    pass


class RunFailed(RuntimeError):
    """A run that cannot go on (its loss is no longer finite): one line, exit code 1, its checkpoints kept."""


class _Required:
    """The default of a key that must be given."""

    def __repr__(self):
        return "REQUIRED"

    def __deepcopy__(self, memo):
        return self


REQUIRED = _Required()

# name: (type or tuple of types, default[, type of a list's items: str unless named]). A dict in place of the tuple
# is a section with its own schema. The default REQUIRED: the key must be given.
COMMON = {
    "model": ((str, type(None)), None),  # hfpatch.models.load name: folder, .gguf, hub id, "smollm2"
    "tokenizer": ((str, type(None)), None),  # defaults to the model's
    "trust_remote_code": (bool, False),  # run the Python code a model folder carries (hfpatch.models.load)
    "allow_pickled_weights": (bool, False),  # load pytorch_model.bin weights when there are no safetensors
    "patch": (dict, {}),  # keyword arguments of hfpatch.patch, e.g. {position: yarn, factor: 4}
    "data": {
        "text_files": ((list, str, type(None)), None),
        "dataset": ((str, type(None)), None),
        "config": ((str, type(None)), None),
        "split": (str, "train"),
        "text_field": (str, "text"),
        "eval_fraction": (float, 0.05),  # share of packed sequences held out for the evaluation loss
        "max_tokens": ((int, type(None)), None),  # cap on the tokens read (after tokenization)
    },
    "seq_len": (int, 512),
    "batch_size": (int, 1),  # per process
    "grad_accum": (int, 1),
    "lr": (float, 1e-4),
    "weight_decay": (float, 0.0),
    "adam_beta2": (float, 0.999),  # AdamW's second-moment decay (torch's default; Xiong et al. 2020 use 0.98)
    "warmup_steps": (int, 10),
    "max_steps": (int, 100),
    "clip": ((float, type(None)), 1.0),
    "seed": (int, 0),
    "precision": (str, "no"),  # accelerate mixed_precision: no | bf16 | fp16
    "gradient_checkpointing": (bool, False),
    # positions per chunk when scoring against the LM head, each chunk recomputed in the backward pass; null =
    # auto: one piece while the [batch, seq_len, vocab] fp32 logits stay under 1 GiB, else chunks of 512
    "loss_chunk": ((int, type(None)), None),
    # positions per tile of each block's feed-forward module, each tile recomputed in the backward pass (memory.py);
    # null = off
    "mlp_tile": ((int, type(None)), None),
    # the loss's gradient made in the forward pass, chunk by chunk (losses.fused_lm_loss): one [loss_chunk, vocab]
    # buffer at a time and no second pass through the LM head; the plain CE only (not with distillation)
    "fused_loss": (bool, False),
    # CPU (glibc): freed tensors of 1 MiB or more go back to the OS instead of staying in malloc's heaps (memory.py)
    "release_memory": (bool, False),
    # torch's fused AdamW kernel: the step makes no parameter-sized temporaries (the default for-each-tensor AdamW
    # makes a few per parameter: three times the embedding matrix's size at its peak)
    "fused_optimizer": (bool, False),
    "lora": {
        "enabled": (bool, False),
        "r": (int, 8),
        "alpha": (int, 16),
        "dropout": (float, 0.0),
        "target_modules": ((list, str), "all-linear"),
    },
    "eval_every": (int, 50),
    "eval_batches": (int, 8),
    "save_every": (int, 100),
    "output_dir": (str, "runs/recipe"),
    "log_with": ((list, str, type(None)), None),  # accelerate trackers (tensorboard, wandb, ...)
    "resume": ((bool, str), False),  # True: the newest checkpoint in output_dir; or a checkpoint folder
    "stop_after": ((int, type(None)), None),  # stop after this step (as if interrupted; resume continues)
    "dtype": (str, "float32"),  # weights in memory: float32 | bfloat16
    # refuse, before the first step, a run whose estimated memory (memory.training_bytes) exceeds what is free
    "memory_check": (bool, True),
}

DISTILL = {
    "distill": {
        "enabled": (bool, False),
        "alpha": (float, 0.5),  # loss = (1 - alpha) * CE + alpha * T^2 * KL(teacher || student)
        "temperature": (float, 1.0),
    }
}

# model built from a config: {model_type: llama, hidden_size: ...}
PRETRAIN: dict[str, tuple] = {
    "model_config": (dict, {}),
    "init": (str, "hf"),  # the first weights (train/init.py): hf (transformers' own) | paper (Xiong et al. 2020)
}

POSE = {
    "pose": {  # positional skip-wise training (pose.py): seq_len tokens, positions spread over target_len
        "target_len": ((int, type(None)), None),  # null = off
        "chunks": (int, 2),  # pieces per sequence, each shifted by its own skip (the paper uses 2)
    }
}

SCHEMAS = {
    "context_extension": {**COMMON, **POSE},
    "heal": {**COMMON, **DISTILL},
    "pretrain": {**COMMON, **PRETRAIN},
}


class Config(dict):
    """A nested dict with attribute access (cfg.data.text_files)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _defaults(schema) -> dict:
    return {k: _defaults(v) if isinstance(v, dict) else copy.deepcopy(v[1]) for k, v in schema.items()}


def _check(schema: dict, values: dict, where: str = "") -> Config:
    out = Config()
    for key, value in values.items():
        name = f"{where}{key}"
        if key not in schema:
            raise ConfigError(f"unknown config key {name!r}; valid keys here: {', '.join(sorted(schema))}")
        spec = schema[key]
        if isinstance(spec, dict):
            if not isinstance(value, dict):
                raise ConfigError(f"{name} must be a section (key: value pairs), got {value!r}")
            out[key] = _check(spec, {**_defaults(spec), **value}, f"{name}.")
            continue
        if value is REQUIRED:
            raise ConfigError(f"{name} is required")
        types, items = spec[0], (spec[2] if len(spec) > 2 else str)
        types = types if isinstance(types, tuple) else (types,)
        value = str(value) if isinstance(value, Word) and str in types and bool not in types else _plain(value)
        if float in types and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if float in types and isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            with contextlib.suppress(ValueError):
                value = float(value)
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise ConfigError(f"{name} must be {names}, got {value!r} ({type(value).__name__})")
        if isinstance(value, list) and not all(isinstance(v, items) and not isinstance(v, bool) for v in value):
            raise ConfigError(f"{name} must be a list of {'strings' if items is str else items.__name__ + 's'}, "
                              f"got {value!r}")
        out[key] = value
    return out


def _set(tree: dict, dotted: str, value) -> None:
    *path, last = dotted.split(".")
    for part in path:
        tree = tree.setdefault(part, {})
        if not isinstance(tree, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
    tree[last] = value


class Word(str):
    """A YAML 1.1 boolean word other than true/false (yes, no, on, off, y, n) as written: a field of type str keeps
    the word (`precision: no` is the string "no", which YAML 1.1 reads as false), any other value reads it as the
    boolean it means (`lora.enabled: yes`, `patch: {exact: no}`)."""

    @property
    def meaning(self) -> bool:
        return self.lower() in ("yes", "y", "on")


class DuplicateKey(Exception):
    pass


class _Loader(yaml.SafeLoader):
    """yaml.SafeLoader that keeps the boolean words (Word) and refuses a key given twice in one mapping (YAML's
    own loader keeps the last value without a word)."""

    def construct_yaml_bool(self, node):
        if node.value.lower() in ("true", "false"):
            return super().construct_yaml_bool(node)
        return Word(node.value)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            lines: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # << merges keys meant to be overridden
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if isinstance(key, Hashable) and key in lines:
                    raise DuplicateKey(f"key {key!r} is given twice (lines {lines[key]} and {line}); keep one")
                if isinstance(key, Hashable):
                    lines[key] = line
        return super().construct_mapping(node, deep=deep)


_Loader.add_constructor("tag:yaml.org,2002:bool", _Loader.construct_yaml_bool)


def _plain(value):
    """`value` with every Word read as the boolean it means (values no schema types: patch, model_config, lists)."""
    if isinstance(value, Word):
        return value.meaning
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _yaml(text: str, where: str):
    """The plain data of a YAML text (a tag such as !!python/object is refused, never imported or called; boolean
    words stay Words, a key given twice is refused), its errors as one ConfigError line."""
    try:
        return yaml.load(text, Loader=_Loader)  # _Loader is a yaml.SafeLoader: plain data only
    except DuplicateKey as e:
        raise ConfigError(f"{where}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        what = " ".join(str(getattr(e, "problem", None) or e).split())
        if "constructor" in what and "python/" in what:
            what += "; configs are plain YAML (numbers, strings, lists, key: value), !!python/ tags are not accepted"
        raise ConfigError(f"{where}: not valid YAML: {what}{at}") from None


MAX_VALUES = 100_000  # a recipe config holds a few hundred; more is an expansion (YAML aliases), not a config


def _check_size(values, limit: int = MAX_VALUES) -> None:
    """Count the values of the config as copies (an alias read twice counts twice), stopping past `limit`: YAML
    aliases let a few kB expand to billions of values, which safe_load builds as shared references in no time, but
    which anything that copies or writes the config (config.json at the final save) expands."""
    count, stack = 0, [values]
    while stack:
        item = stack.pop()
        count += 1
        if count > limit:
            raise ConfigError(f"the config holds more than {limit} values (YAML anchors and aliases expand to "
                              "copies); a recipe config needs a few hundred")
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def read(path: str | None, overrides: list[str]) -> dict:
    """The values of a YAML file (none: {}) with `key=value` overrides (dotted keys reach into sections, values are
    YAML), not yet checked."""
    values: dict = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {path}")
        values = _yaml(p.read_text(), str(path)) or {}
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: expected key: value pairs at the top level")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key=value")
        _set(values, key.strip(), _yaml(raw, f"override {item!r}") if raw.strip() else None)
    _check_size(values)
    return values


def check(schema: dict, values: dict) -> Config:
    """`values` over the schema's defaults (a section key by key, any other key as a whole), every key checked."""
    merged = _defaults(schema)
    for key, value in values.items():
        if isinstance(schema.get(key), dict) and isinstance(value, dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return _check(schema, merged)


def load(recipe: str, path: str | None, overrides: list[str], check_previous: bool = True) -> Config:
    """The checked config. check_previous=False leaves out the check that output_dir holds no earlier run (the
    recipes' command line makes it after locking output_dir: check_fresh)."""
    cfg = check(SCHEMAS[recipe], read(path, overrides))
    _expand_home(cfg)
    _validate(cfg, recipe)
    if check_previous:
        check_fresh(cfg)
    return cfg


def _expand_home(cfg: Config) -> None:
    """~ at the start of a path means the home folder, as in a shell (YAML leaves it as it is)."""
    expand = os.path.expanduser
    for key in ("model", "tokenizer", "output_dir"):
        if isinstance(cfg[key], str):
            cfg[key] = expand(cfg[key])
    if isinstance(cfg.resume, str):
        cfg["resume"] = expand(cfg.resume)
    files = cfg.data.text_files
    if files is not None:
        cfg.data["text_files"] = expand(files) if isinstance(files, str) else [expand(f) for f in files]


def _validate(cfg: Config, recipe: str) -> None:
    if recipe != "pretrain" and not cfg.model:
        raise ConfigError("model is required (a folder, a .gguf file, a hub id or 'smollm2')")
    if recipe == "pretrain" and not cfg.model_config.get("model_type"):
        raise ConfigError("model_config.model_type is required (e.g. llama), with the model's sizes")
    if recipe == "pretrain" and not cfg.tokenizer:
        raise ConfigError("tokenizer is required for pretrain (a folder, a .gguf file or 'smollm2')")
    for key in ("seq_len", "batch_size", "grad_accum", "max_steps", "eval_every", "save_every", "eval_batches",
                "loss_chunk", "mlp_tile"):
        if cfg[key] is not None and cfg[key] <= 0:
            raise ConfigError(f"{key} must be > 0, got {cfg[key]}")
    if cfg.warmup_steps < 0:
        raise ConfigError(f"warmup_steps must be >= 0, got {cfg.warmup_steps}")
    _check_numbers(cfg)
    if cfg.precision not in ("no", "bf16", "fp16"):
        raise ConfigError(f"precision must be no, bf16 or fp16, got {cfg.precision!r}")
    if cfg.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"dtype must be float32 or bfloat16, got {cfg.dtype!r}")
    if cfg.data.max_tokens is not None and cfg.data.max_tokens <= 0:
        raise ConfigError(f"data.max_tokens must be > 0 (the most tokens read from the data) or null (no cap), got "
                          f"{cfg.data.max_tokens}")
    if not 0.0 <= cfg.data.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction must be in [0, 1), got {cfg.data.eval_fraction}")
    if recipe == "pretrain" and cfg.model:
        raise ConfigError("pretrain builds its model from model_config; remove model (or use context_extension/heal)")
    if recipe == "pretrain":
        check_model_config(cfg.model_config)
        if cfg.init not in INITS:
            raise ConfigError(f"init must be one of {', '.join(INITS)}; got {cfg.init!r}")
    files = cfg.data.text_files  # neither files nor a dataset: the default corpus (Python stdlib sources)
    for f in [files] if isinstance(files, str) else (files or []):
        if not Path(f).exists():
            raise ConfigError(f"data path not found: {f}")
        if Path(f).is_dir() and not any(p.is_file() for p in Path(f).rglob("*.txt")):
            raise ConfigError(f"data: folder {f} has no .txt files (folders contribute their *.txt files)")
    _check_trackers(cfg.log_with)
    pose = cfg.get("pose")
    if pose and pose.target_len is not None:
        if not cfg.seq_len < pose.target_len <= MAX_POSITIONS:
            raise ConfigError(f"pose.target_len={pose.target_len} must be an integer greater than seq_len="
                              f"{cfg.seq_len} (PoSE spreads seq_len positions over target_len) and at most "
                              f"{MAX_POSITIONS} (RoPE computes its angles in float32, exact for positions up to 2^24)")
        if not 2 <= pose.chunks <= cfg.seq_len:
            raise ConfigError(f"pose.chunks must be between 2 and seq_len={cfg.seq_len}, got {pose.chunks}")
    if cfg.fused_loss and "distill" in cfg and cfg.distill.enabled:
        raise ConfigError("fused_loss computes the plain cross-entropy only; distillation scores the KL to the teacher "
                          "through loss_chunk: remove fused_loss")
    if "distill" in cfg and cfg.distill.enabled and not 0.0 <= cfg.distill.alpha <= 1.0:
        raise ConfigError(f"distill.alpha must be in [0, 1], got {cfg.distill.alpha}")
    try:
        spec.request(**cfg.patch)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"patch: {e}") from None


# The most positions a run may train for: RoPE multiplies the position ids by its frequencies in float32, whose
# integers are exact up to 2^24; past it neighbouring positions get the same angles. It bounds what no model's window
# bounds (dynamic scaling, which has none).
MAX_POSITIONS = 2**24

SEED_MAX = 2**32 - 1  # numpy's seed range (accelerate's set_seed seeds numpy too)


def _check_numbers(cfg: Config) -> None:
    """Numbers that would train to NaN, train backwards, or fail deep inside: refused with their valid range. The
    upper bound on lr: AdamW moves every weight by about lr per step, so an lr above 1 destroys any model (1e308
    trained to inf weights and wrote them into checkpoints)."""
    if not (math.isfinite(cfg.lr) and 0 < cfg.lr <= 1):
        raise ConfigError(f"lr must be a finite number in (0, 1], got {cfg.lr}")
    if not (math.isfinite(cfg.adam_beta2) and 0 <= cfg.adam_beta2 < 1):
        raise ConfigError(f"adam_beta2 must be a number in [0, 1), got {cfg.adam_beta2}")
    if not (math.isfinite(cfg.weight_decay) and cfg.weight_decay >= 0):
        raise ConfigError(f"weight_decay must be a finite number >= 0, got {cfg.weight_decay}")
    if cfg.lr * cfg.weight_decay >= 1:  # AdamW multiplies every weight by 1 - lr * weight_decay each step
        raise ConfigError(f"lr x weight_decay must stay below 1 (each step multiplies the weights by 1 - lr x "
                          f"weight_decay), got lr={cfg.lr}, weight_decay={cfg.weight_decay}")
    if cfg.clip is not None and not (math.isfinite(cfg.clip) and cfg.clip > 0):
        raise ConfigError(f"clip must be a finite number > 0 or null (no clipping), got {cfg.clip}")
    if not 0 <= cfg.seed <= SEED_MAX:
        raise ConfigError(f"seed must be between 0 and {SEED_MAX}, got {cfg.seed}")
    if "distill" in cfg and not (math.isfinite(cfg.distill.temperature) and cfg.distill.temperature > 0):
        raise ConfigError(f"distill.temperature must be a finite number > 0, got {cfg.distill.temperature}")
    lora = cfg.lora
    if lora.enabled and (lora.r <= 0 or lora.alpha <= 0 or not 0 <= lora.dropout < 1):
        raise ConfigError(f"lora needs r > 0, alpha > 0 and dropout in [0, 1), got r={lora.r}, alpha={lora.alpha}, "
                          f"dropout={lora.dropout}")


# model_config keys that are sizes or counts: a value <= 0 builds no model (or a model of nothing)
_SIZE = re.compile(r"(^|_)(size|dim|layers|heads|positions|position_embeddings|experts|n_embd|n_layer|n_head|"
                   r"n_inner|ffn_dim)($|_)|^num_")


def check_model_config(options: dict) -> None:
    """model_config against the config class of its model_type: every key must be a setting of the class (a typo,
    stored by transformers as a plain attribute and ignored, would be written into config.json), sizes > 0, and
    the class must accept the values together."""
    options = dict(options)
    model_type = options.pop("model_type")
    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING), n=3)
        raise ConfigError(f"model_config.model_type {model_type!r} is not a model type of the installed "
                          f"transformers{f' (did you mean {close[0]}?)' if close else ''}")
    for key, value in options.items():
        if _SIZE.search(key) and isinstance(value, int) and not isinstance(value, bool) and value <= 0:
            raise ConfigError(f"model_config.{key} must be > 0, got {value}")
    cls = CONFIG_MAPPING[model_type]
    try:
        built = cls(**options)
    except (ValueError, TypeError, AttributeError, StrictDataclassError) as e:  # values that do not fit together
        raise ConfigError(f"model_config: {' '.join(str(e).split())}") from None
    known = set(getattr(cls, "attribute_map", {}))
    known |= {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    # transformers keeps a key it does not know as a plain attribute; the ones it knows (rope_theta,
    # attn_implementation, ...) are turned into settings and not kept under their own name
    unknown = [k for k in options if k not in known and k in vars(built)]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, sorted(known), n=1)
        raise ConfigError(f"model_config: {key} is not a setting of {cls.__name__}"
                          f"{f' (did you mean {close[0]}?)' if close else ''}")


def _check_trackers(log_with) -> None:
    """accelerate raises on an unknown tracker name and quietly drops one whose package is missing."""
    if not log_with:
        return
    for name in [log_with] if isinstance(log_with, str) else log_with:
        if name not in LoggerType.list():
            raise ConfigError(f"log_with: unknown tracker {name!r}; accelerate knows {', '.join(LoggerType.list())}")
        if name != "all" and LoggerType(name) not in get_available_trackers():
            raise ConfigError(f"log_with: {name} is not installed (install its package, or leave it out)")


def check_fresh(cfg: Config) -> None:
    """A run that does not resume needs an output_dir without an earlier run in it."""
    found = None if cfg.resume else previous_run(Path(cfg.output_dir))
    if found:
        raise ConfigError(f"output_dir {cfg.output_dir} already holds a run ({found}); resume=true continues it, or "
                          "choose another output_dir")


def previous_run(out: Path) -> str | None:
    """What in `out` shows that a run was already made there (None if nothing)."""
    log = out / "log.jsonl"
    ckpts = out / "checkpoints"
    found = [name for name, there in (("log.jsonl", log.is_file() and log.stat().st_size > 0),
                                      ("checkpoints/", ckpts.is_dir() and any(ckpts.iterdir())),
                                      ("final/", (out / "final").exists())) if there]
    return ", ".join(found) or None
