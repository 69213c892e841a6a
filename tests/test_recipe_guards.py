"""Recipes never train silently wrong and never lose a run: values that would corrupt training are refused before
any work, a resume continues only the run it was made by (same settings, same data, checkpoint content verified,
progress agreeing with the files), a diverging run stops at its step with its last good checkpoint, two runs cannot
share an output_dir, and what used to end in a traceback is one line. (Kills at any moment:
tests/test_recipe_faults.py.)"""

import errno
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, stdlib_text
from safetensors import SafetensorError

from hfpatch.train import checkpoint, config, loop
from hfpatch.train.cli import run
from hfpatch.utils.files import Lock

TINY = ("model_config={model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
        "num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 128}")
TIMEOUT = 180


def recipe(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "recipes" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "stdlib.txt"
    path.write_text(stdlib_text(60_000))
    return path


@pytest.fixture
def base(tiny_tokenizer_dir, text, tmp_path):
    """pretrain's arguments for a tiny run into tmp_path/out (8 steps, a checkpoint every 2)."""
    return [TINY, f"tokenizer={tiny_tokenizer_dir}", f"data.text_files=[{text}]", "seq_len=32", "batch_size=2",
            "max_steps=8", "eval_every=4", "save_every=2", "lr=3e-3", "warmup_steps=2",
            f"output_dir={tmp_path / 'out'}"]


def refused(capsys, argv, main=None) -> str:
    """The one error line of a pretrain run that must be refused (exit 2) without training."""
    capsys.readouterr()
    assert run("pretrain", main or recipe("pretrain").main, argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1, errors
    return errors[0]


# --------------------------------------------------------------------------- values refused before any work


def _non_utf8(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9 cr\xe8me ".encode("latin-1") * 100)
    return path


def _no_txt(tmp_path):
    path = tmp_path / "folder"
    path.mkdir()
    (path / "notes.md").write_text("text, but not in a .txt file")
    return path


# each override, and what the one error line refusing it says
CORRUPTING = {
    "lr=.inf": "lr must be a finite number in (0, 1], got inf",
    "lr=.nan": "lr must be a finite number in (0, 1], got nan",
    "lr=1e308": "lr must be a finite number in (0, 1], got 1e+308",
    "clip=.nan": "clip must be a finite number > 0 or null (no clipping), got nan",
    "clip=-1": "clip must be a finite number > 0 or null (no clipping), got -1.0",
    "seed=-1": "seed must be between 0 and 4294967295, got -1",
    "weight_decay=-5": "weight_decay must be a finite number >= 0",
    "weight_decay=1e5": "lr x weight_decay must stay below 1",
    "data.eval_fraction=.nan": "data.eval_fraction must be in [0, 1), got nan",
    "model_config.hidden_sise=128": "model_config: hidden_sise is not a setting of LlamaConfig (did you mean "
                                    "hidden_size?)",
    "model_config.hidden_size=-4": "model_config.hidden_size must be > 0, got -4",
    "model_config.num_hidden_layers=0": "model_config.num_hidden_layers must be > 0, got 0",
    "output_dir=/proc/hfpatch-test/run": "output_dir /proc/hfpatch-test/run: cannot create it",
    "data.text_files=[{non_utf8}]": "not UTF-8 text",
    "data.text_files=[{no_txt}]": "has no .txt files",
    "batch_size=100000": "memory_check=false to try anyway",
}


@pytest.mark.parametrize("arg,message", CORRUPTING.items())
def test_values_that_would_corrupt_or_crash_training_are_one_error(base, capsys, tmp_path, arg, message):
    files = {"non_utf8": _non_utf8(tmp_path), "no_txt": _no_txt(tmp_path)}
    args = [arg.format(**files)]

    def main(cfg):
        if any(a.startswith("batch_size") for a in args):  # the memory check is in the loop, before any step
            with pytest.MonkeyPatch.context() as m:
                m.setattr(loop, "prepare", lambda *a, **k: pytest.fail("training was prepared"))
                return recipe("pretrain").main(cfg)
        return recipe("pretrain").main(cfg)

    line = refused(capsys, [*base, *args], main)
    assert message is None or message in line, line
    assert not (tmp_path / "out").exists()  # nothing left behind by a refused run


def _bomb(levels=9, width=9) -> str:
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]")
    return "\n".join(lines)


def test_a_yaml_bomb_is_refused_at_once(tmp_path, capsys):
    """Anchors and aliases that expand to 9^9 = 387 million strings (a few kB of YAML): refused by size while the
    config is read, instead of training and then hanging at the final save."""
    path = tmp_path / "bomb.yaml"
    path.write_text("model_config:\n  model_type: llama\n  rope_parameters:\n    " +
                    _bomb().replace("\n", "\n    ") + "\n")
    line = refused(capsys, ["--config", str(path), "tokenizer=smollm2"], lambda cfg: pytest.fail("ran"))
    assert "more than 100000 values" in line, line


# --------------------------------------------------------------------------------------------- one output_dir


def test_a_second_run_on_a_locked_output_dir_is_refused_with_the_holders_pid(base, capsys, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with Lock(out / "hfpatch.lock", "x"):  # as a run in progress holds it
        line = refused(capsys, [*base, "resume=true"], lambda cfg: pytest.fail("ran"))
    assert f"process {os.getpid()}" in line and str(out) in line, line


def _command(args, *extra):
    return [sys.executable, str(REPO / "recipes" / "pretrain.py"), *args, *extra]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def test_two_runs_started_at_once_on_one_output_dir(base, tmp_path):
    """Both launched together with resume=true (which skips the check for an earlier run; two such runs used to
    train side by side, one crashing on the other's checkpoint folders, the log holding both): one trains, the
    other is refused naming the first's pid; the log holds one run. Both are asked for far more steps than they
    get, so neither can finish (and free the lock) before the other has tried it: the one that exits is the
    refused one, and the trainer is then killed."""
    long_run = [*base, "max_steps=1000000", "save_every=1000000", "eval_every=1000000"]
    procs = [subprocess.Popen(_command(long_run, "resume=true"), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env()) for _ in range(2)]
    log = tmp_path / "out" / "log.jsonl"
    try:
        refused_proc = _until(lambda: next((p for p in procs if p.poll() is not None), None),
                              f"neither run ended within {TIMEOUT} s: both are training")
        (winner,) = [p for p in procs if p is not refused_proc]
        err = refused_proc.stderr.read()
        assert refused_proc.returncode == 2, err
        assert f"process {winner.pid}" in err, err
        assert winner.poll() is None, "the run holding the lock ended"
        _until(lambda: log.exists() and len(log.read_text().splitlines()) >= 2,  # the winner trains
               f"{log} has fewer than 2 rows after {TIMEOUT} s")
    finally:
        for p in procs:
            p.kill()
            p.wait()
    rows = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert rows == list(range(1, len(rows) + 1)), rows


def _until(found, failure: str, timeout: float = TIMEOUT):
    """found()'s first truthy value, polled every 0.1 s; AssertionError(failure) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := found():
            return value
        time.sleep(0.1)
    raise AssertionError(failure)


# ------------------------------------------------------------------------------------------ a diverging run


@pytest.fixture
def fresh_accelerate():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_a_loss_that_is_no_longer_finite_stops_the_run_at_its_step(tmp_path, fresh_accelerate):
    """The forward turns to NaN at step 5: the run stops there with the step, before the optimizer steps with NaN
    gradients; step_2 and step_4 stay as they were written, no step_6 or final model is written, and the log holds
    the finite rows 1-4."""
    from conftest import tiny_model

    out = tmp_path / "out"
    cfg = config.load("pretrain", None, [TINY, "tokenizer=x", "seq_len=16", "batch_size=2", "max_steps=8",
                                         "save_every=2", "eval_every=100", "warmup_steps=0", "lr=1e-3",
                                         f"output_dir={out}"])
    model = tiny_model("llama")
    seqs = torch.randint(3, 101, (40, 16), generator=torch.Generator().manual_seed(0))
    forwards = [0]

    def poison(module, args, output):
        forwards[0] += 1
        return output * float("nan") if forwards[0] == 5 else output

    model.get_input_embeddings().register_forward_hook(poison)
    with pytest.raises(config.RunFailed, match=r"stopped at step 5: the loss is nan.*step_4 is kept"):
        loop.train(cfg, model, None, seqs[:36], seqs[36:])
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2", "step_4"]
    assert not (out / "final").exists()
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert checkpoint.problem(out / "checkpoints" / "step_4") is None


# ------------------------------------------------------------------------------------- resume: the same run only


def tiny_cfg(out, *extra):
    return config.load("pretrain", None, [TINY, "tokenizer=x", "seq_len=16", "batch_size=2", "max_steps=6",
                                          "save_every=2", "eval_every=100", "warmup_steps=0", "lr=1e-3",
                                          f"output_dir={out}", *extra])


def tiny_train(cfg, seed=0):
    """loop.train on a tiny llama (the same initial weights every time) and 40 random sequences of `seed`."""
    from accelerate.state import AcceleratorState
    from conftest import tiny_model

    AcceleratorState._reset_state(reset_partial_state=True)
    seqs = torch.randint(3, 101, (40, cfg.seq_len), generator=torch.Generator().manual_seed(seed))
    try:
        return loop.train(cfg, tiny_model("llama"), None, seqs[:36], seqs[36:])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def steps_logged(out):
    return [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]


def test_a_resume_with_changed_settings_is_refused_listing_what_differs(tmp_path):
    """resume=true seq_len=8 lr=0.5 used to halve the tokens per step and ignore the new lr without a word."""
    out = tmp_path / "out"
    tiny_train(tiny_cfg(out, "stop_after=2"))
    with pytest.raises(config.ConfigError) as e:
        tiny_train(tiny_cfg(out, "resume=true", "seq_len=8", "lr=0.5"))
    message = str(e.value)
    assert "lr 0.001 -> 0.5" in message and "seq_len 16 -> 8" in message, message
    assert "another output_dir" in message
    assert steps_logged(out) == [1, 2]  # nothing trained, nothing cut


def test_a_resume_with_other_data_is_refused(tmp_path):
    out = tmp_path / "out"
    tiny_train(tiny_cfg(out, "stop_after=2"))
    with pytest.raises(config.ConfigError, match="the training data"):
        tiny_train(tiny_cfg(out, "resume=true"), seed=1)
    tiny_train(tiny_cfg(out, "resume=true", "stop_after=4", "save_every=4", "eval_every=3", "memory_check=false"))
    assert steps_logged(out) == [1, 2, 3, 4]  # what may change (when to save or evaluate): accepted


def _flip_a_bit(folder):
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-100] ^= 1  # a weight's bit: same size
    path.write_bytes(bytes(data))


def _marker(folder, change, reseal=False):
    """Edit the marker; with reseal, its own SHA-256 is made again too (a forgery consistent in every part the
    seal covers, to reach the checks behind it)."""
    path = folder / checkpoint.MARKER
    info = json.loads(path.read_text())
    change(info)
    path.write_text(json.dumps(checkpoint.seal(info) if reseal else info))


def _lr_5000x(marker):
    scheduler = marker["states"]["scheduler"]
    scheduler["base_lrs"] = [lr * 5000 for lr in scheduler["base_lrs"]]


def _zero(folder, name, count=None):
    path = folder / name
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.write(bytes(count or size))
    assert path.stat().st_size == size


@pytest.mark.parametrize("tamper,reason", [
    (_flip_a_bit, "model.safetensors: its content is not what was saved"),
    (lambda f: _zero(f, "model.safetensors", 8), "model.safetensors: its content is not what was saved"),
    (lambda f: _zero(f, "optimizer.bin"), "optimizer.bin: its content is not what was saved"),
    (lambda f: _marker(f, lambda m: m.pop("states")), "no states"),
    (lambda f: _marker(f, lambda m: m["states"]["progress"].update(step=2), reseal=True),
     "progress is at step 2, not 4"),
    (lambda f: _marker(f, lambda m: m["states"]["scheduler"].update(last_epoch=1), reseal=True),
     "LR schedule is at step 1"),
    (lambda f: _marker(f, _lr_5000x), "hfpatch_checkpoint.json was edited after it was saved"),
    (lambda f: _marker(f, lambda m: m["states"]["scheduler"].update(last_epoch=1)),
     "hfpatch_checkpoint.json was edited after it was saved"),
    (lambda f: _marker(f, lambda m: m["files"].pop("optimizer.bin")), "optimizer.bin is not listed"),
])
def test_a_tampered_checkpoint_is_skipped_for_the_older_complete_one(tmp_path, capsys, tamper, reason):
    """step_4 damaged in place (same sizes) or its marker edited: the resume says why it skips it, continues from
    step_2, and the log holds every step once; the run ends as an untouched one does."""
    out, whole = tmp_path / "out", tmp_path / "whole"
    tiny_train(tiny_cfg(whole))
    tiny_train(tiny_cfg(out, "stop_after=4"))
    tamper(out / "checkpoints" / "step_4")
    capsys.readouterr()
    tiny_train(tiny_cfg(out, "resume=true"))
    said = capsys.readouterr().out
    assert "skipped step_4:" in said and reason in said, said
    assert f"resumed from {out / 'checkpoints' / 'step_2'} at step 2" in said
    assert steps_logged(out) == [1, 2, 3, 4, 5, 6]
    rows = lambda o: [(r["step"], r["loss"]) for r in map(json.loads, (o / "log.jsonl").read_text().splitlines())]
    assert rows(out) == rows(whole)


FULL = [OSError(errno.ENOSPC, "No space left on device"),
        SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")]


@pytest.mark.parametrize("error", FULL, ids=["OSError", "SafetensorError"])
def test_a_full_disk_is_one_line_and_keeps_the_complete_checkpoints(base, tmp_path, capsys, fresh_accelerate,
                                                                     monkeypatch, error):
    """The disk fills while step_4 is written: one line that says so and names step_4 (exit 1), step_2 complete
    and resumable, nothing of step_4 left (safetensors reports a full disk as a SafetensorError)."""
    import accelerate.utils.other as accelerate_io

    real, calls = accelerate_io.safe_save_file, [0]

    def filling(tensors, filename, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            Path(filename).write_bytes(b"half a file")
            raise error
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(accelerate_io, "safe_save_file", filling)
    capsys.readouterr()
    assert run("pretrain", recipe("pretrain").main, base) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    out = tmp_path / "out"
    assert len(errors) == 1 and "resume=true" in errors[0], errors
    assert f"could not write {out / 'checkpoints' / 'step_4'}: no space left on the device" in errors[0], errors
    assert checkpoint.problem(out / "checkpoints" / "step_2") is None
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2"]


@pytest.mark.parametrize("error", FULL, ids=["OSError", "SafetensorError"])
def test_a_full_disk_at_the_final_save_is_one_line_and_leaves_no_partial_final(base, tmp_path, capsys,
                                                                                fresh_accelerate, monkeypatch, error):
    import transformers.modeling_utils as modeling_utils

    def full(tensors, filename, *args, **kwargs):
        Path(filename).write_bytes(b"half a file")
        raise error

    monkeypatch.setattr(modeling_utils, "safe_save_file", full)
    capsys.readouterr()
    assert run("pretrain", recipe("pretrain").main, base) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    out = tmp_path / "out"
    assert len(errors) == 1 and f"could not write {out / 'final'}: no space left on the device" in errors[0], errors
    assert not (out / "final").exists() and not (out / "final.partial").exists()
    assert checkpoint.problem(out / "checkpoints" / "step_8") is None


def test_a_marker_edited_consistently_is_refused_by_the_optimizers_own_count(tmp_path):
    """step_4 renamed step_6 with its marker's step, progress and LR schedule all set to 6: the files still hold 4
    optimizer steps, which AdamW's state says after loading. Refused (the loaded weights are not a fresh start's),
    instead of a run that skips steps 5 and 6."""
    out = tmp_path / "out"
    tiny_train(tiny_cfg(out, "stop_after=4"))
    folder = out / "checkpoints" / "step_4"

    def to_6(m):
        m["step"] = 6
        m["states"]["progress"]["step"] = 6
        m["states"]["scheduler"].update(last_epoch=6, _step_count=7)

    _marker(folder, to_6, reseal=True)
    folder.rename(out / "checkpoints" / "step_6")
    with pytest.raises(config.ConfigError, match="the optimizer state has made 4 steps, the marker says 6"):
        tiny_train(tiny_cfg(out, "resume=true"))
    assert steps_logged(out) == [1, 2, 3, 4]
