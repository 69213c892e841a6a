"""recipes/compare.py resumes an interrupted run from its newest *complete* checkpoint (a folder a kill left
half-written, step_N.partial, or a damaged newer one is skipped), and the gradient-norm rows follow: numbered from the
step training resumes at, one row per step."""

from __future__ import annotations

import json

import torch
from accelerate import Accelerator

from hfpatch import tiny
from hfpatch.train import checkpoint
from recipes.studies import measure, study


def _checkpoints(root):
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(2, 2))
    for step in (2, 4, 6):
        checkpoint.save(accelerator, root, step, {})
    return root


def test_the_newest_step_skips_a_folder_being_written_and_a_damaged_one(tmp_path):
    root = _checkpoints(tmp_path / "checkpoints")
    (root / "step_6" / "model.safetensors").write_bytes(b"damaged")  # a newer checkpoint whose weights changed
    (root / "step_8.partial").mkdir()  # a kill during the write of step 8
    (root / "step_8.partial" / "model.safetensors").write_bytes(b"half")
    assert study.newest_checkpoint_step(tmp_path) == 4
    assert study.newest_checkpoint(tmp_path) == root / "step_4"


def test_no_complete_checkpoint_is_step_zero(tmp_path):
    (tmp_path / "checkpoints" / "step_4.partial").mkdir(parents=True)
    assert study.newest_checkpoint_step(tmp_path) == 0 and study.newest_checkpoint(tmp_path) is None


def test_gradient_norm_rows_resume_at_the_step_training_resumes_at(tmp_path):
    path = tmp_path / "grad_norms.jsonl"
    path.write_text("".join(json.dumps({"step": s, "final": 1.0}) + "\n" for s in range(1, 7)))
    model = tiny.build_tiny("llama")
    rec = measure.GradNorms(model, path, first_step=4)  # training resumes from step_4, rows 5 and 6 are redone
    try:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        ids = tiny.sample_ids(1, 8)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    finally:
        rec.close()
    steps = [row["step"] for row in measure.read_jsonl(path)]
    assert steps == [1, 2, 3, 4, 5]
