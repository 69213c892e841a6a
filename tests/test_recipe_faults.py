"""A recipe killed with SIGKILL at any moment (while training, while a checkpoint or the final model is written)
and resumed ends with exactly the loss curve and the final model of an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, stdlib_text

import hfpatch
from eval import faults
from hfpatch.train import checkpoint
from hfpatch.train.config import ConfigError
from hfpatch.utils.files import sha256

TINY = ("model_config={model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
        "num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 128}")
TIMEOUT = 120  # seconds for one launch (about 6 s here); a hang fails the test instead of blocking the suite


@pytest.fixture(scope="module")
def args(tmp_path_factory, tiny_tokenizer_dir):
    text = tmp_path_factory.mktemp("data") / "stdlib.txt"
    text.write_text(stdlib_text(300_000))
    # dropout on: the resumed run must also restore the RNG states to match
    return [TINY, "model_config.attention_dropout=0.1", f"tokenizer={tiny_tokenizer_dir}",
            f"data.text_files=[{text}]", "seq_len=128", "batch_size=2", "max_steps=8", "eval_every=4",
            "save_every=2", "lr=3e-3", "warmup_steps=2"]


def command(args, out, *extra):
    return [sys.executable, str(REPO / "recipes" / "pretrain.py"), *args, f"output_dir={out}", *extra]


def env():
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def finish(args, out, *extra):
    proc = subprocess.run(command(args, out, *extra), capture_output=True, text=True, cwd=REPO, env=env(),
                          timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def rows(out):
    return [json.loads(line) for line in (Path(out) / "log.jsonl").read_text().splitlines()]


def curve(out):
    return [(r["step"], r["loss"], r.get("eval_loss"), r["lr"], r["tokens"])
            for r in rows(out)]


def final_logits(out):
    x = torch.arange(3, 60)[None]
    with torch.no_grad():
        return hfpatch.from_pretrained(Path(out) / "final")(x).logits


@pytest.fixture(scope="module")
def reference(args, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "run"
    finish(args, out)
    return out


def assert_same_run(reference, out):
    assert curve(out) == curve(reference)
    assert torch.equal(final_logits(out), final_logits(reference))


def test_killed_as_soon_as_step_2_appears_resumes_to_the_uninterrupted_curve(args, reference, tmp_path):
    """The defect of issue 15 as found from outside: SIGKILL as soon as anything named step_2 shows up under
    checkpoints/, then the same command with resume=true."""
    out = tmp_path / "run"
    proc = subprocess.Popen(command(args, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
                            env=env())
    deadline = time.monotonic() + TIMEOUT
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            folder = out / "checkpoints"
            if folder.is_dir() and any("step_2" in name for name in os.listdir(folder)):
                break
            time.sleep(0.0005)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed at step_2"
    resumed = finish(args, out, "resume=true")
    assert "resumed from" in resumed.stdout or "starting from step 0" in resumed.stdout, resumed.stdout
    assert_same_run(reference, out)


def faulty(args, out, kill: str, at: int, *extra):
    """The recipe under eval.faults, killed at the `at`-th file event under `out` matching `kill`."""
    cmd = faults.command(REPO / "recipes" / "pretrain.py", [*args, f"output_dir={out}", *extra], out, at, kill)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env(), timeout=TIMEOUT)
    assert proc.returncode == -signal.SIGKILL, f"not killed at {kill!r}: {proc.stderr[-3000:]}"
    return proc.stdout


def test_killed_inside_saves_and_log_writes_resumes_to_the_uninterrupted_run(args, reference, tmp_path):
    """One run killed four times, each time at a different kind of moment, each resume starting from the newest
    complete checkpoint; in the end the same log rows and final model as the run that was never killed."""
    out = tmp_path / "run"
    # inside save_state: the first checkpoint's weights half-written
    faulty(args, out, r"^save_file checkpoints/step_2\.partial/", 0)
    assert not (out / "checkpoints" / "step_2").exists()
    # nothing complete to resume from: a fresh start, said so; killed with step_4 written but not yet renamed
    said = faulty(args, out, r"^rename checkpoints/step_4\.partial$", 0, "resume=true")
    assert "no complete checkpoint" in said and "starting from step 0" in said
    # resumes from step_2 (step_4.partial is ignored); killed while writing step 6's log row
    said = faulty(args, out, r"^open log\.jsonl$", 3, "resume=true")
    assert f"resumed from {out / 'checkpoints' / 'step_2'} at step 2" in said
    assert (out / "log.jsonl").read_text().count("\n") == 5  # rows 1-5 and half of row 6
    # resumes from step_4; killed while the final model's weights are written
    said = faulty(args, out, r"^save_file final\.partial/", 0, "resume=true")
    assert "at step 4" in said and not (out / "final").exists()
    # resumes from step_8, the last step: only the final save is left to do
    assert "at step 8" in finish(args, out, "resume=true").stdout
    assert_same_run(reference, out)
    assert not [p.name for p in [*out.iterdir(), *(out / "checkpoints").iterdir()] if p.name.endswith(".partial")]


# ----------------------------------------------------------------------------------- checkpoint folders, in-process

@pytest.fixture
def accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)


class Counter:
    def __init__(self, n=0):
        self.n = n

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def saved(accelerator, root, steps=(2, 4)):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    counter = Counter()
    for step in steps:
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        counter.n = step
        checkpoint.save(accelerator, root, step, {"counter": counter})
    return model, counter


def test_only_folders_with_a_matching_marker_are_complete(accelerator, tmp_path):
    root = tmp_path / "checkpoints"
    saved(accelerator, root, steps=(2, 4, 6, 8))
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4", "step_6", "step_8"]
    assert all(checkpoint.problem(root / f"step_{s}") is None for s in (2, 4, 6, 8))
    weights = root / "step_8" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])  # cut short after the rename
    (root / "step_6" / "optimizer.bin").unlink()
    (root / "step_4" / checkpoint.MARKER).write_text('{"step": 4, "fi')
    (root / "step_10").mkdir()  # an older hfpatch's folder, or one made by hand: no marker
    path, skipped = checkpoint.newest_complete(root)
    assert path == root / "step_2"
    assert [line.split(":")[0] for line in skipped] == ["step_10", "step_8", "step_6", "step_4"]
    assert "no hfpatch_checkpoint.json" in skipped[0] and "model.safetensors has" in skipped[1]
    assert "optimizer.bin is missing" in skipped[2] and "unreadable" in skipped[3]
    (root / "step_2").rename(root / "step_12")
    assert "holds step 2" in checkpoint.problem(root / "step_12")
    assert checkpoint.newest_complete(root)[0] is None


def test_resume_loads_the_newest_complete_checkpoint_and_cuts_the_log(accelerator, tmp_path):
    model, counter = saved(accelerator, tmp_path / "checkpoints", steps=(2, 4))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    (tmp_path / "checkpoints" / "step_6.partial").mkdir()  # a killed save
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    counter.n = -1
    step = checkpoint.resume(accelerator, True, tmp_path, {"counter": counter}, log)
    assert step == 4 and counter.n == 4
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3, 4]
    assert not (tmp_path / "checkpoints" / "step_6.partial").exists()
    with pytest.raises(ConfigError, match=r"is not a complete checkpoint: no hfpatch_checkpoint\.json"):
        checkpoint.resume(accelerator, str(tmp_path), tmp_path, {"counter": counter}, log)


class Payload:
    """Unpickling this runs code: it creates the file `path`."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (Path(self.path),)


def test_a_checkpoint_pickle_that_would_run_code_is_refused_unread(accelerator, tmp_path):
    root = tmp_path / "checkpoints"
    saved(accelerator, root, steps=(2,))
    folder, ran = root / "step_2", tmp_path / "payload-ran"
    torch.save({"state": {}, "param_groups": [], "x": Payload(ran)}, folder / "optimizer.bin")
    marker = json.loads((folder / checkpoint.MARKER).read_text())
    marker["files"]["optimizer.bin"] = {"bytes": (folder / "optimizer.bin").stat().st_size,  # a consistent forgery
                                        "sha256": sha256(folder / "optimizer.bin")}
    (folder / checkpoint.MARKER).write_text(json.dumps(checkpoint.seal(marker)))  # its own hash made again too
    with pytest.raises(ConfigError, match="refused unread"):
        checkpoint.resume(accelerator, True, tmp_path, {"counter": Counter()}, tmp_path / "log.jsonl")
    assert not ran.exists()
    torch.load(folder / "optimizer.bin", weights_only=False)  # what a plain torch.load would have done
    assert ran.exists()
