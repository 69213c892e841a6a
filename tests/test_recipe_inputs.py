"""Recipe configs read as written (`precision: no` is the string the schema names, a key given twice is refused),
sizes without a meaning refused with what is accepted, the memory check's reserve, and Ctrl-C as one line that says
how to resume."""

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, stdlib_text

from hfpatch.lm import budget
from hfpatch.train import config, memory

TINY = ("model_config={model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
        "num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 128}")
TIMEOUT = 120


def load(tmp_path, *overrides, text=None, recipe="pretrain"):
    path = None
    if text is not None:
        path = tmp_path / "run.yaml"
        path.write_text(text)
    base = [TINY, "tokenizer=x"] if recipe == "pretrain" else ["model=smollm2"]
    return config.load(recipe, path, [*base, f"output_dir={tmp_path / 'out'}", *overrides])


# ------------------------------------------------------------------------------------------- YAML read as written


def test_precision_no_in_yaml_is_the_string_no(tmp_path):
    assert load(tmp_path, text="precision: no\n").precision == "no"


def test_precision_no_as_an_override_is_the_string_no(tmp_path):
    assert load(tmp_path, "precision=no").precision == "no"


def test_boolean_words_still_mean_booleans_where_a_boolean_is_expected(tmp_path):
    cfg = load(tmp_path, text="gradient_checkpointing: yes\nlora: {enabled: on}\nmemory_check: no\n")
    assert cfg.gradient_checkpointing is True and cfg.lora.enabled is True and cfg.memory_check is False
    cfg = load(tmp_path, "patch={norm: rmsnorm, exact: no}")
    assert cfg.patch == {"norm": "rmsnorm", "exact": False}


def test_a_key_given_twice_is_refused_naming_it_and_its_lines(tmp_path):
    with pytest.raises(config.ConfigError, match=r"key 'lr' is given twice \(lines 1 and 3\); keep one"):
        load(tmp_path, text="lr: 0.001\nseq_len: 32\nlr: 0.5\n")
    with pytest.raises(config.ConfigError, match=r"key 'r' is given twice \(lines 2 and 3\)"):
        load(tmp_path, text="lora:\n  r: 4\n  r: 8\n")


# -------------------------------------------------------------------------------------- sizes without a meaning


@pytest.mark.parametrize("value", [0, -1])
def test_max_tokens_zero_or_negative_is_refused(tmp_path, value):
    with pytest.raises(config.ConfigError, match=rf"data.max_tokens must be > 0 .* or null \(no cap\), got {value}"):
        load(tmp_path, f"data.max_tokens={value}")


@pytest.mark.parametrize("value,message", [
    ("1000000000000", "at most 16777216"),
    ("16777217", "at most 16777216"),
    ("1e12", "pose.target_len must be int or null, got '1e12'"),
    ("2500.5", "pose.target_len must be int or null, got 2500.5 (float)"),
])
def test_pose_target_len_beyond_what_rope_can_tell_apart_is_refused(tmp_path, value, message):
    with pytest.raises(config.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load(tmp_path, "patch={position: dynamic, factor: 4}", f"pose.target_len={value}", recipe="context_extension")
    cfg = load(tmp_path, "patch={position: dynamic, factor: 4}", "pose.target_len=16777216",
               recipe="context_extension")
    assert cfg.pose.target_len == 2**24


# ------------------------------------------------------------------------------------------ the memory reserve


@pytest.mark.parametrize("share,fits", [(0.95, False), (0.89, True)])
def test_the_memory_check_keeps_a_tenth_of_free_memory_in_reserve(monkeypatch, tmp_path, share, fits):
    free = 23_500_000_000
    monkeypatch.setattr(budget, "available_memory", lambda device, limit: (free, "CPU"))
    need = int(free * share)
    monkeypatch.setattr(memory, "training_bytes", lambda cfg, model, teacher, processes: {
        "weights": 0, "optimizer": 0, "activations": need, "logits": 0, "total": need})
    cfg = load(tmp_path)
    if fits:
        memory.check_fits(cfg, None)
        return
    with pytest.raises(ValueError, match=r"21.9 GiB is free on the CPU, of which 10% is kept in reserve "
                                         r"\(19.7 GiB usable\)"):
        memory.check_fits(cfg, None)


# ----------------------------------------------------------------------------------------------------- Ctrl-C


def _ctrl_c_as_in_a_terminal() -> None:
    """SIGINT at its default in the child: a pytest-xdist worker ignores SIGINT, and an ignored signal stays ignored
    across exec, so the recipe would never see the Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_a_recipe_is_one_line_with_the_resume_command(tmp_path, tiny_tokenizer_dir):
    text = tmp_path / "stdlib.txt"
    text.write_text(stdlib_text(300_000))
    out = tmp_path / "run"
    args = [TINY, f"tokenizer={tiny_tokenizer_dir}", f"data.text_files=[{text}]", "seq_len=128", "batch_size=2",
            "max_steps=100000", "save_every=2", "eval_every=1000", f"output_dir={out}"]
    proc = subprocess.Popen([sys.executable, str(REPO / "recipes" / "pretrain.py"), *args], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=_ctrl_c_as_in_a_terminal)
    deadline = time.monotonic() + TIMEOUT
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if (out / "checkpoints" / "step_2").is_dir():  # training, and a checkpoint to resume from
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [line for line in err.splitlines() if line.startswith("pretrain:")]
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith("pretrain: interrupted; continue from the newest complete "
                                                   "checkpoint with: accelerate launch "), err[-3000:]
    assert lines[0].endswith(f"output_dir={out} resume=true"), lines[0]
