"""A compare study (recipes/compare.py): N small models that differ in one axis only. Every arm is the same
`pretrain` config (model, data, tokenizer, steps, seed) with a few overrides (the axis: a patch, a depth, the warm-up);
each run is exactly `recipes/pretrain.py` with those overrides (the JSON records the equivalent command).

The study's own config is a dataclass (StudyConfig) built and checked by the recipes' config builder (train/config.py);
every arm's pretrain config is checked like any pretrain config, before anything trains.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hfpatch.train import checkpoint, config
from hfpatch.train.config import ConfigError, PretrainConfig, required, setting


@dataclass(frozen=True, kw_only=True)
class Evaluate:
    """What a study measures on every run besides its training."""

    text_files: list[str] | None = setting(None, "held-out text (not trained on); null: no text evaluations")
    tokens_per_doc: int = setting(16384, "tokens of the held-out text scored at every length")
    lengths: list[int] | None = setting(None, "perplexity at these lengths (chunks); null: seq_len only")
    passkey: dict[str, Any] | None = setting(None, "{arms: [...], lengths: [...], depths: [...], trials: n}")
    recall: dict[str, Any] | None = setting(None, "{distances: [...], span: 32, trials: 16}: the repeated-span probe")
    batch_statistics: bool = setting(False, "batch norms: running statistics at batch 1 vs the batch's own")
    grad_norms: bool = setting(False, "record per-layer gradient norms every step")
    step_time_rounds: int = setting(0, "> 0: time a training step of every arm side by side, this many rounds")


@dataclass(frozen=True, kw_only=True)
class StudyConfig:
    """A compare study: its arms are `pretrain` with each arm's overrides, once per seed. Checked once when made;
    `arms` then holds the grid's combinations too."""

    study: str = required("the study's name: its files are `compare_<study>.json`, `.md`, `.png` in output_dir")
    pretrain: dict[str, Any] = required("a recipes/pretrain.py config shared by every arm")
    arms: dict[str, Any] = setting({}, "arm name -> overrides of `pretrain` (dotted keys allowed): the one axis that "
                                   "differs")
    # one arm per combination of labels (named label-label-..., after `arms`), its overrides those of its labels
    # together (two axes may not set the same key)
    grid: dict[str, Any] = setting({}, "axis -> {label: overrides}: one arm per combination of labels")
    seeds: list[int] = setting([0], "every arm runs once per seed (init and data order)")
    tokenizer_vocab: int = setting(2048, "vocabulary of the BPE trained on the training text if the tokenizer is "
                                   "absent")
    output_dir: str = setting("runs/compare", "where the runs and the study's files go")
    evaluate: Evaluate = field(default_factory=Evaluate, metadata={"help": "what is measured (section)",
                                                                     "path": False})

    def __post_init__(self) -> None:
        # the grid's combinations join the arms (a frozen dataclass sets its own field once, here)
        object.__setattr__(self, "arms", {**self.arms, **{name: arm for name, (_, arm) in
                                                          grid_arms(self.grid).items()}})
        if not self.arms:
            raise ConfigError("arms must name at least one arm (or grid at least one combination)")
        if not self.seeds:
            raise ConfigError(f"seeds must be a non-empty list of integers, got {self.seeds!r}")
        for name, arm in self.arms.items():
            if not isinstance(arm, dict):
                raise ConfigError(f"arms.{name} must be a mapping of pretrain overrides, got {arm!r}")
        ev = self.evaluate
        if ev.step_time_rounds and not ev.text_files:
            raise ConfigError("evaluate.step_time_rounds times training steps on the held-out text: set "
                              "evaluate.text_files too")
        for f in ev.text_files or []:
            if not Path(f).exists():
                raise ConfigError(f"evaluate.text_files: not found: {f}")
        for key, asked in (("passkey", ev.passkey), ("recall", ev.recall)):
            if asked is not None:
                unknown = sorted(set(asked.get("arms", [])) - set(self.arms))
                if unknown:
                    raise ConfigError(f"evaluate.{key}.arms names unknown arms {unknown}; arms: "
                                      f"{', '.join(self.arms)}")

    def as_dict(self) -> dict[str, Any]:
        """The study as nested plain data (what its JSON records as `config`)."""
        return dataclasses.asdict(self)


def load_study(path: str | None, overrides: list[str]) -> StudyConfig:
    """The study config (YAML + key=value overrides with dotted keys, e.g. pretrain.max_steps=20), checked."""
    return config.build(StudyConfig, config.read(path, overrides))


def grid_arms(grid: dict) -> dict[str, tuple[dict, dict]]:
    """{arm name: ({axis: label}, overrides)} for every combination of the grid's labels, the first axis varying
    slowest; {} for no grid."""
    for axis, values in grid.items():
        if not isinstance(values, dict) or not values or not all(isinstance(v, dict) for v in values.values()):
            raise ConfigError(f"grid.{axis} must map each label to a mapping of pretrain overrides, got {values!r}")
    out: dict[str, tuple[dict, dict]] = {}
    for combo in itertools.product(*(list(values.items()) for values in grid.values())):
        labels = {axis: str(label) for axis, (label, _) in zip(grid, combo)}
        merged: dict = {}
        for axis, (label, arm) in zip(grid, combo):
            twice = sorted(set(merged) & set(arm))
            if twice:
                raise ConfigError(f"grid.{axis}.{label} sets {', '.join(twice)}, which another axis sets too")
            merged.update(arm)
        out["-".join(labels.values()) if grid else ""] = (labels, merged)
    return out if grid else {}


def _flatten(overrides: dict, prefix: str = "") -> list[str]:
    """{a: {b: 1}} -> ["a.b=1"] (sections the pretrain schema merges key by key); patch and model_config values that
    are whole dicts stay whole (the pretrain config replaces them as a whole)."""
    out = []
    for key, value in overrides.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and name not in ("patch", "model_config") and value:
            out += _flatten(value, name + ".")
        else:
            out.append(f"{name}={yaml.safe_dump(value, default_flow_style=True, width=1 << 20).strip()}")
            out[-1] = out[-1].removesuffix("\n...").removesuffix(" ...")
    return out


@dataclass
class Run:
    arm: str
    seed: int
    out: Path
    overrides: list[str]  # the pretrain overrides that make this run
    cfg: PretrainConfig  # the checked pretrain config

    @property
    def name(self) -> str:
        return self.arm if self.out.name == self.arm else f"{self.arm}/{self.out.name}"

    @property
    def command(self) -> str:
        return "accelerate launch recipes/pretrain.py " + " ".join(f"'{o}'" for o in self.overrides)


def claim(run: Run) -> None:
    """A run folder remembers the settings it was trained with: reusing it for other ones is refused (a study whose
    config changed would otherwise keep old runs as if they were the new ones)."""
    marker = run.out / "compare_run.json"
    if marker.exists():
        had = json.loads(marker.read_text())["overrides"]
        if had != run.overrides:
            changed = sorted(set(had) ^ set(run.overrides))
            raise ConfigError(f"{run.out} holds a run made with other settings ({', '.join(changed)}); use another "
                              "output_dir, or delete that folder to train it again")
        return
    run.out.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"arm": run.arm, "seed": run.seed, "overrides": run.overrides}, indent=1) + "\n")


def plan(study: StudyConfig) -> list[Run]:
    """Every (arm, seed) as a checked pretrain config: a bad arm fails now, before anything trains."""
    runs = []
    base = _flatten(study.pretrain)
    several = len(study.seeds) > 1
    for arm, extra in study.arms.items():
        for seed in study.seeds:
            out = Path(study.output_dir) / arm
            out = out / f"seed{seed}" if several else out
            overrides = base + _flatten(extra) + [f"seed={seed}", f"output_dir={out}"]
            try:
                # a study started again continues its runs: their folders may hold one (train() resumes it)
                cfg = config.build(PretrainConfig, config.read(None, [*overrides, "resume=true"]))
            except ConfigError as e:
                raise ConfigError(f"arm {arm!r}: {e}") from None
            _check_reloadable(arm, cfg, study.evaluate)
            runs.append(Run(arm, seed, out, overrides, cfg))
    return runs


def _check_reloadable(arm: str, cfg: PretrainConfig, ev: Evaluate) -> None:
    """The perplexity and passkey evaluations load the saved model in `hfpatch eval`, which does not know the
    embedding scale of init=paper (init.py): refused rather than scored as another model."""
    if cfg.init == "paper" and (ev.text_files or ev.passkey is not None):
        raise ConfigError(f"arm {arm!r}: init=paper scales the embedding output at run time, which the model that "
                          "`hfpatch eval` loads does not do; leave evaluate.text_files and evaluate.passkey out "
                          "(the run's own held-out loss is measured in training)")


def newest_checkpoint(out: Path) -> Path | None:
    """The checkpoint an interrupted run goes on from: the newest complete one under out/checkpoints (folders a kill
    left half-written, step_N.partial, and damaged ones are skipped, as a recipe's resume=true skips them)."""
    return checkpoint.newest_complete(out / "checkpoints")[0]


def newest_checkpoint_step(out: Path) -> int:
    """The step of newest_checkpoint(out) (0: none)."""
    path = newest_checkpoint(out)
    return 0 if path is None else checkpoint.step_of(path)
