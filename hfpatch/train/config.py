"""Recipe configs: a YAML file, then `key=value` overrides from the command line (dotted keys reach into sections,
values are parsed as YAML: `lr=3e-4`, `data.text_files=[a.txt,b.txt]`, `patch.position=yarn`).

Each recipe's config is a frozen dataclass (PretrainConfig, ContextExtensionConfig, HealConfig over RecipeConfig;
the sections data, lora, pose, distill are dataclasses of their own), so that the recipes read typed fields
(`cfg.data.max_tokens`) the type checker sees. `build` makes one from the plain values of the YAML and the
overrides: every key is checked against the dataclass's fields and their types before anything is loaded, and the
dataclass checks the values together when it is made (`__post_init__`): an unknown key, a wrong type, a value out
of range or a missing data path is one clear error (ConfigError), never ignored.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelerate.tracking import get_available_trackers
from accelerate.utils import LoggerType
from huggingface_hub.errors import StrictDataclassError
from transformers import CONFIG_MAPPING

from .. import spec
from .init import INITS
from .values import MAX_VALUES, REQUIRED, ConfigError, DuplicateKey, Word, build, keys, read

__all__ = [  # the names other modules import from here, the reading of values included
    "ConfigError", "RunFailed", "setting", "required", "Data", "Lora", "Pose", "Distill", "RecipeConfig",
    "PretrainConfig", "ContextExtensionConfig", "HealConfig", "RECIPES", "MAX_POSITIONS", "SEED_MAX", "REQUIRED",
    "build", "keys", "read", "load", "check_model_config", "check_fresh", "previous_run", "Word", "DuplicateKey",
    "MAX_VALUES",
]


class RunFailed(RuntimeError):
    """A run that cannot go on (its loss is no longer finite): one line, exit code 1, its checkpoints kept."""


def setting(default: Any, help: str, *, path: bool = False) -> Any:
    """A config field: its default (a dict or list is copied for every config), what it means (the reference table
    of the docs reads it) and, with path=True, a path whose leading ~ is the home folder, as in a shell."""
    metadata = {"help": help, "path": path}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def required(help: str) -> Any:
    """A config field that must be given."""
    return field(metadata={"help": help, "path": False})


# ---------------------------------------------------------------------------------------------------- the sections

@dataclass(frozen=True, kw_only=True)
class Data:
    """What the recipe trains on: text files or folders, a `datasets` dataset, or neither (the default corpus)."""

    text_files: list[str] | str | None = setting(None, "text files, or folders of .txt files", path=True)
    dataset: str | None = setting(None, "a `datasets` dataset name (in place of text_files)")
    config: str | None = setting(None, "the dataset's configuration")
    split: str = setting("train", "the dataset's split")
    text_field: str = setting("text", "the dataset's column of text")
    eval_fraction: float = setting(0.05, "share of packed sequences held out for the evaluation loss, in [0, 1)")
    max_tokens: int | None = setting(None, "cap on the tokens read (after tokenization); null: no cap")


@dataclass(frozen=True, kw_only=True)
class Lora:
    """LoRA adapters through peft (the patch is applied first; the final save merges them)."""

    enabled: bool = setting(False, "train LoRA adapters instead of every weight")
    r: int = setting(8, "the adapters' rank")
    alpha: int = setting(16, "peft's lora_alpha")
    dropout: float = setting(0.0, "peft's lora_dropout, in [0, 1)")
    target_modules: list[str] | str = setting("all-linear", "the modules that get adapters (peft's names)")


@dataclass(frozen=True, kw_only=True)
class Pose:
    """Positional skip-wise training (pose.py): seq_len tokens, their positions spread over target_len."""

    target_len: int | None = setting(None, "the window PoSE trains for, above seq_len; null: PoSE off")
    chunks: int = setting(2, "pieces per sequence, each shifted by its own skip (the paper uses 2)")


@dataclass(frozen=True, kw_only=True)
class Distill:
    """Distillation from the model before the swap: loss = (1 - alpha) * CE + alpha * T^2 * KL(teacher || student)."""

    enabled: bool = setting(False, "distil from the unpatched model")
    alpha: float = setting(0.5, "the KL's share of the loss, in [0, 1]")
    temperature: float = setting(1.0, "T, > 0")


# ---------------------------------------------------------------------------------------------------- the recipes

@dataclass(frozen=True, kw_only=True)
class RecipeConfig:
    """What every recipe takes. Made by `build` (or directly, in Python), checked once when made."""

    model: str | None = setting(None, "the model (hfpatch.models.load): a folder, a .gguf file, a hub id, smollm2",
                                path=True)
    tokenizer: str | None = setting(None, "the tokenizer; null: the model's", path=True)
    trust_remote_code: bool = setting(False, "run the Python code a model folder carries")
    allow_pickled_weights: bool = setting(False, "load pytorch_model.bin weights when there are no safetensors")
    patch: dict[str, Any] = setting({}, "keyword arguments of hfpatch.patch, e.g. {position: yarn, factor: 4}")
    data: Data = field(default_factory=Data, metadata={"help": "the training text (section)", "path": False})
    seq_len: int = setting(512, "tokens per packed sequence")
    batch_size: int = setting(1, "sequences per step, per process")
    grad_accum: int = setting(1, "micro-batches per optimizer step")
    lr: float = setting(1e-4, "peak learning rate, in (0, 1]")
    weight_decay: float = setting(0.0, "AdamW's weight decay, >= 0")
    # torch's default; Xiong et al. 2020 use 0.98
    adam_beta2: float = setting(0.999, "AdamW's second-moment decay, in [0, 1)")
    warmup_steps: int = setting(10, "steps of linear warm-up before the cosine decay")
    max_steps: int = setting(100, "optimizer steps")
    clip: float | None = setting(1.0, "gradient-norm clipping; null: none")
    seed: int = setting(0, "initialisation and data order, in [0, 2^32 - 1]")
    precision: str = setting("no", "accelerate's mixed precision: no, bf16 or fp16")
    gradient_checkpointing: bool = setting(False, "recompute every block in the backward pass")
    loss_chunk: int | None = setting(None, "positions per chunk scored against the LM head, each chunk recomputed in "
                                     "the backward pass; null: one piece while the fp32 logits stay under 1 GiB, "
                                     "else chunks of 512")
    mlp_tile: int | None = setting(None, "positions per tile of each block's feed-forward module, each tile "
                                   "recomputed in the backward pass; null: off")
    fused_loss: bool = setting(False, "the loss's gradient made in the forward pass, chunk by chunk (plain "
                               "cross-entropy only, not with distillation)")
    release_memory: bool = setting(False, "CPU (glibc): freed tensors of 1 MiB or more go back to the OS")
    fused_optimizer: bool = setting(False, "torch's fused AdamW kernel (no parameter-sized temporaries)")
    lora: Lora = field(default_factory=Lora, metadata={"help": "LoRA adapters (section)", "path": False})
    eval_every: int = setting(50, "steps between evaluations of the held-out loss")
    eval_batches: int = setting(8, "batches of the held-out loss")
    save_every: int = setting(100, "steps between checkpoints")
    output_dir: str = setting("runs/recipe", "where the log, checkpoints and final model go", path=True)
    log_with: list[str] | str | None = setting(None, "accelerate trackers (tensorboard, wandb, ...)")
    resume: bool | str = setting(False, "true: the newest checkpoint in output_dir; or a checkpoint folder",
                                 path=True)
    stop_after: int | None = setting(None, "stop after this step, as if interrupted (resume continues)")
    dtype: str = setting("float32", "weights in memory: float32 or bfloat16")
    memory_check: bool = setting(True, "refuse, before the first step, a run whose estimated memory exceeds what "
                                 "is free")

    def __post_init__(self) -> None:
        self._check_source()
        self._check_common()
        self._check_own()
        try:
            spec.request(**self.patch)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"patch: {e}") from None

    def as_dict(self) -> dict[str, Any]:
        """The config as nested plain data (sections as dicts), as YAML would write it."""
        return dataclasses.asdict(self)

    def pose_positions(self) -> tuple[int, int] | None:
        """(target_len, chunks) when the run trains with PoSE (None: plain positions)."""
        return None

    def distillation(self) -> Distill | None:
        """The distillation settings when the run distils from a teacher (None: it does not)."""
        return None

    def _check_source(self) -> None:
        """Where the model comes from: a recipe that fine-tunes needs one."""
        if not self.model:
            raise ConfigError("model is required (a folder, a .gguf file, a hub id or 'smollm2')")

    def _check_own(self) -> None:
        """The checks of one recipe's own keys (none here)."""

    def _check_common(self) -> None:
        for key in ("seq_len", "batch_size", "grad_accum", "max_steps", "eval_every", "save_every", "eval_batches",
                    "loss_chunk", "mlp_tile"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ConfigError(f"{key} must be > 0, got {value}")
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        self._check_numbers()
        if self.precision not in ("no", "bf16", "fp16"):
            raise ConfigError(f"precision must be no, bf16 or fp16, got {self.precision!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        data = self.data
        if data.max_tokens is not None and data.max_tokens <= 0:
            raise ConfigError(f"data.max_tokens must be > 0 (the most tokens read from the data) or null (no cap), "
                              f"got {data.max_tokens}")
        if not 0.0 <= data.eval_fraction < 1.0:
            raise ConfigError(f"data.eval_fraction must be in [0, 1), got {data.eval_fraction}")
        files = data.text_files  # neither files nor a dataset: the default corpus (Python stdlib sources)
        for f in [files] if isinstance(files, str) else (files or []):
            if not Path(f).exists():
                raise ConfigError(f"data path not found: {f}")
            if Path(f).is_dir() and not any(p.is_file() for p in Path(f).rglob("*.txt")):
                raise ConfigError(f"data: folder {f} has no .txt files (folders contribute their *.txt files)")
        _check_trackers(self.log_with)

    def _check_numbers(self) -> None:
        """Numbers that would train to NaN, train backwards, or fail deep inside: refused with their valid range.
        The upper bound on lr: AdamW moves every weight by about lr per step, so an lr above 1 destroys any model
        (1e308 trained to inf weights and wrote them into checkpoints)."""
        lr, decay = self.lr, self.weight_decay
        if not (math.isfinite(lr) and 0 < lr <= 1):
            raise ConfigError(f"lr must be a finite number in (0, 1], got {lr}")
        if not (math.isfinite(self.adam_beta2) and 0 <= self.adam_beta2 < 1):
            raise ConfigError(f"adam_beta2 must be a number in [0, 1), got {self.adam_beta2}")
        if not (math.isfinite(decay) and decay >= 0):
            raise ConfigError(f"weight_decay must be a finite number >= 0, got {decay}")
        if lr * decay >= 1:  # AdamW multiplies every weight by 1 - lr * weight_decay each step
            raise ConfigError(f"lr x weight_decay must stay below 1 (each step multiplies the weights by 1 - lr x "
                              f"weight_decay), got lr={lr}, weight_decay={decay}")
        if self.clip is not None and not (math.isfinite(self.clip) and self.clip > 0):
            raise ConfigError(f"clip must be a finite number > 0 or null (no clipping), got {self.clip}")
        if not 0 <= self.seed <= SEED_MAX:
            raise ConfigError(f"seed must be between 0 and {SEED_MAX}, got {self.seed}")
        lora = self.lora
        if lora.enabled and (lora.r <= 0 or lora.alpha <= 0 or not 0 <= lora.dropout < 1):
            raise ConfigError(f"lora needs r > 0, alpha > 0 and dropout in [0, 1), got r={lora.r}, "
                              f"alpha={lora.alpha}, dropout={lora.dropout}")


@dataclass(frozen=True, kw_only=True)
class PretrainConfig(RecipeConfig):
    """recipes/pretrain.py: a model built from model_config, trained from scratch."""

    model_config: dict[str, Any] = setting({}, "the transformers config the model is built from: model_type and "
                                           "sizes (the vocabulary comes from the tokenizer)")
    # the tokenizer must be given (its None default is "not given", refused with what it takes): a str once made
    tokenizer: str = setting(None, "the tokenizer (required): a folder, a .gguf file or smollm2", path=True)
    init: str = setting("hf", "the first weights (train/init.py): hf (transformers' own) or paper (Xiong et al. "
                        "2020)")

    def _check_source(self) -> None:
        if not self.model_config.get("model_type"):
            raise ConfigError("model_config.model_type is required (e.g. llama), with the model's sizes")
        if not self.tokenizer:
            raise ConfigError("tokenizer is required for pretrain (a folder, a .gguf file or 'smollm2')")

    def _check_own(self) -> None:
        if self.model:
            raise ConfigError("pretrain builds its model from model_config; remove model (or use "
                              "context_extension/heal)")
        check_model_config(self.model_config)
        if self.init not in INITS:
            raise ConfigError(f"init must be one of {', '.join(INITS)}; got {self.init!r}")


@dataclass(frozen=True, kw_only=True)
class ContextExtensionConfig(RecipeConfig):
    """recipes/context_extension.py: a pretrained model patched (e.g. YaRN x4) and fine-tuned at seq_len."""

    pose: Pose = field(default_factory=Pose, metadata={"help": "PoSE (section)", "path": False})

    def pose_positions(self) -> tuple[int, int] | None:
        return None if self.pose.target_len is None else (self.pose.target_len, self.pose.chunks)

    def _check_own(self) -> None:
        pose = self.pose
        if pose.target_len is None:
            return
        if not self.seq_len < pose.target_len <= MAX_POSITIONS:
            raise ConfigError(f"pose.target_len={pose.target_len} must be an integer greater than seq_len="
                              f"{self.seq_len} (PoSE spreads seq_len positions over target_len) and at most "
                              f"{MAX_POSITIONS} (RoPE computes its angles in float32, exact for positions up to 2^24)")
        if not 2 <= pose.chunks <= self.seq_len:
            raise ConfigError(f"pose.chunks must be between 2 and seq_len={self.seq_len}, got {pose.chunks}")


@dataclass(frozen=True, kw_only=True)
class HealConfig(RecipeConfig):
    """recipes/heal.py: after a swap, fine-tune back toward the original model, optionally distilling from it."""

    distill: Distill = field(default_factory=Distill, metadata={"help": "distillation (section)", "path": False})
    calibrate: int = setting(0, "training sequences hfpatch.calibrate fits the patch on before the first step (DyT's "
                                "α, BatchNorm's running statistics, Peri-LN's output norms), batch_size at a time; "
                                "0: none")

    def distillation(self) -> Distill | None:
        return self.distill if self.distill.enabled else None

    def _check_own(self) -> None:
        if self.calibrate < 0:
            raise ConfigError(f"calibrate must be >= 0 (training sequences; 0: none), got {self.calibrate}")
        distill = self.distill
        if not (math.isfinite(distill.temperature) and distill.temperature > 0):
            raise ConfigError(f"distill.temperature must be a finite number > 0, got {distill.temperature}")
        if self.fused_loss and distill.enabled:
            raise ConfigError("fused_loss computes the plain cross-entropy only; distillation scores the KL to the "
                              "teacher through loss_chunk: remove fused_loss")
        if distill.enabled and not 0.0 <= distill.alpha <= 1.0:
            raise ConfigError(f"distill.alpha must be in [0, 1], got {distill.alpha}")


RECIPES: dict[str, type[RecipeConfig]] = {
    "context_extension": ContextExtensionConfig,
    "heal": HealConfig,
    "pretrain": PretrainConfig,
}

# The most positions a run may train for: RoPE multiplies the position ids by its frequencies in float32, whose
# integers are exact up to 2^24; past it neighbouring positions get the same angles. It bounds what no model's window
# bounds (dynamic scaling, which has none).
MAX_POSITIONS = 2**24

SEED_MAX = 2**32 - 1  # numpy's seed range (accelerate's set_seed seeds numpy too)


# ---------------------------------------------------------------------------------------------------- loading one

def load(recipe: str, path: str | None, overrides: list[str], check_previous: bool = True) -> RecipeConfig:
    """The recipe's checked config (RECIPES[recipe]). check_previous=False leaves out the check that output_dir
    holds no earlier run (the recipes' command line makes it after locking output_dir: check_fresh)."""
    cfg = build(RECIPES[recipe], read(path, overrides))
    if check_previous:
        check_fresh(cfg)
    return cfg


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


def check_fresh(cfg: RecipeConfig) -> None:
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
