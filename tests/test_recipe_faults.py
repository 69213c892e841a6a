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
    return [(r["step"], r["loss"], r["eval_loss"] if "eval_loss" in r else None, r["lr"], r["tokens"])
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
