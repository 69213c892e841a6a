"""Recipe configs are frozen dataclasses checked once, when made (from YAML and overrides, or in Python), and the run
identity a resume compares is the one checkpoints written before them hold."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from hfpatch.train import config, loop
from hfpatch.train.config import ConfigError
from recipes.studies import study

IDENTITIES = Path(__file__).parent / "data" / "run_identities.json"


def test_a_recipe_config_is_a_frozen_dataclass_with_typed_sections():
    cfg = config.load("heal", None, ["model=x", "distill.enabled=true", "data.max_tokens=1000", "lora.r=4"],
                      check_previous=False)
    assert isinstance(cfg, config.HealConfig) and isinstance(cfg.data, config.Data)
    assert isinstance(cfg.distill, config.Distill) and isinstance(cfg.lora, config.Lora)
    assert (cfg.data.max_tokens, cfg.lora.r, cfg.distill.enabled, cfg.distill.alpha) == (1000, 4, True, 0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 0.5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.data.max_tokens = 5  # type: ignore[misc]


def test_each_recipe_has_only_its_own_sections():
    """pose is context_extension's, distill heal's, model_config and init pretrain's: elsewhere they are unknown."""
    assert "pose" in {f.name for f in dataclasses.fields(config.ContextExtensionConfig)}
    with pytest.raises(ConfigError, match="unknown config key 'pose'; valid keys here: adam_beta2, "):
        config.load("heal", None, ["model=x", "pose.target_len=1024"], check_previous=False)
    with pytest.raises(ConfigError, match=r"unknown config key 'distill\.temp'; valid keys here: alpha, enabled, "
                                          "temperature"):
        config.load("heal", None, ["model=x", "distill.temp=2"], check_previous=False)


@pytest.mark.parametrize("make, message", [
    (lambda: config.HealConfig(model="x", lr=5.0), r"lr must be a finite number in \(0, 1\], got 5.0"),
    (lambda: config.HealConfig(), "model is required"),
    (lambda: config.ContextExtensionConfig(model="x", seq_len=64, pose=config.Pose(target_len=32)),
     "pose.target_len=32 must be an integer greater than seq_len=64"),
    (lambda: config.HealConfig(model="x", distill=config.Distill(enabled=True, alpha=2.0)),
     r"distill.alpha must be in \[0, 1\], got 2.0"),
    (lambda: config.PretrainConfig(model_config={"model_type": "llama"}, tokenizer="x", init="nope"),
     "init must be one of"),
    (lambda: config.HealConfig(model="x", patch={"position": "t6"}), "patch: unknown position scheme 't6'"),
])
def test_a_config_made_in_python_is_checked_as_a_config_file_is(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_a_changed_copy_is_checked_again():
    cfg = config.load("context_extension", None, ["model=x"], check_previous=False)
    assert dataclasses.replace(cfg, seq_len=256).seq_len == 256
    with pytest.raises(ConfigError, match="seq_len must be > 0, got 0"):
        dataclasses.replace(cfg, seq_len=0)


@pytest.mark.parametrize("case", sorted(json.loads(IDENTITIES.read_text())["cases"]))
def test_the_run_identity_is_the_one_earlier_checkpoints_hold(case, monkeypatch):
    """The settings part of run_identity, which every checkpoint marker holds and a resume compares, is the one
    recipes wrote before configs were dataclasses (recorded in tests/data/run_identities.json): their checkpoints
    still resume."""
    recorded = json.loads(IDENTITIES.read_text())["cases"][case]
    monkeypatch.setattr(loop, "model_fingerprint", lambda name: {"stub": name})  # model "x" is no real model
    cfg = config.load(recorded["recipe"], None, [*recorded["overrides"], "output_dir=/nonexistent/out"])
    seqs = torch.zeros(2, 4, dtype=torch.long)
    assert loop.run_identity(cfg, seqs, seqs)["settings"] == recorded["settings"]


def test_a_study_that_times_steps_needs_held_out_text(tmp_path):
    """step_time_rounds times a step on the held-out text: without text_files the study is refused before it trains,
    not after every arm has trained."""
    values = {"study": "s", "pretrain": {"tokenizer": "x", "model_config": {"model_type": "llama"}},
              "arms": {"a": {}}, "output_dir": str(tmp_path), "evaluate": {"step_time_rounds": 2}}
    with pytest.raises(ConfigError, match=r"evaluate\.step_time_rounds times training steps on the held-out text"):
        config.build(study.StudyConfig, values)
