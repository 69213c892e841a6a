"""The prepared GPU check (eval/gpu_check.sh): its dry run on the CPU runs every step's code on tiny shapes, so the
script cannot rot between GPU runs; the model travels in parts and is joined only when whole and unchanged; the
perplexity comparison flags a cell outside the bf16 tolerance."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from eval import gpu_check

REPO = Path(__file__).resolve().parent.parent


def test_the_model_is_joined_only_when_every_part_is_there_and_unchanged(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "PART_SIZE", 10)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(bytes(range(25)))
    parts = tmp_path / "parts"
    assert [p.name for p in gpu_check.split_model(gguf, parts)] == ["1", "2", "3"]
    staged = tmp_path / "staged"
    carried = tmp_path / "carried"
    for i in ("1", "3"):  # one call's carry, then another's: part 2 not yet
        (carried / i).mkdir(parents=True)
        for f in ("part", "MANIFEST.json"):
            (carried / i / f).write_bytes((parts / i / f).read_bytes())
    assert gpu_check.stage_model(carried, staged)["missing"] == [2]
    (carried / "2").mkdir()
    (carried / "2" / "part").write_bytes(b"x" * 10)  # a corrupted part
    (carried / "2" / "MANIFEST.json").write_bytes((parts / "2" / "MANIFEST.json").read_bytes())
    assert gpu_check.stage_model(carried, staged)["path"] is None
    assert not (staged / "m.gguf").exists()
    (carried / "2" / "part").write_bytes((parts / "2" / "part").read_bytes())
    joined = gpu_check.stage_model(carried, staged)["path"]
    assert Path(joined).read_bytes() == bytes(range(25))


def test_a_perplexity_cell_outside_the_tolerance_differs(tmp_path):
    def cells(nll):
        return {"settings": {"dtype": "bf16"}, "cells": [{"patch": "yarn:4", "length": 32768, "mean_nll": nll,
                                                           "ppl": 2.718 ** nll}]}

    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps(cells(3.725)))
    close, far = tmp_path / "close.json", tmp_path / "far.json"
    close.write_text(json.dumps(cells(3.725 + gpu_check.NLL_TOLERANCE / 2)))
    far.write_text(json.dumps(cells(3.725 + 2 * gpu_check.NLL_TOLERANCE)))
    assert gpu_check.ppl_compare(close, [ref])["agree"]
    result = gpu_check.ppl_compare(far, [ref])
    assert not result["agree"] and result["cells"][0]["status"] == "differs"


@pytest.mark.slow
def test_the_dry_run_runs_every_step_or_says_why_not(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(REPO / "eval" / "gpu_check.sh"), "--dry-run"], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "OUT": str(out), "OMP_NUM_THREADS": "1"}, timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    steps = {s["name"]: s for s in summary["steps"]}
    assert set(steps) >= {"wheels", "tests", "bench-infer", "bench-train", "recipe", "ppl"}, proc.stdout[-3000:]
    if (REPO / ".whl").is_dir():  # bash eval/gpu_wheels.sh was run here
        assert steps["wheels"]["status"] == "ok", proc.stdout[-3000:]
    for name in ("tests", "bench-infer", "bench-train", "recipe"):
        assert steps[name]["status"] == "ok", (name, proc.stdout[-3000:])
    assert steps["ppl"]["status"] == "ok" or steps["ppl"]["detail"]  # skipped only saying why (no model or text)
    assert summary["tests"]["failed"] == [] and summary["tests"]["passed"] == 0  # no CUDA: every cuda test skips
    assert any("CUDA" in why for why in summary["tests"]["skipped"])
    bench = json.loads((out / "bench_train.json").read_text())["cells"]
    assert "seconds" in bench["unpatched@256"] and bench["alibi@256"]["ran"]
    assert "skipped" in bench["floor:fa4@256"] and "seconds" in json.loads(
        (out / "bench_infer.json").read_text())["cells"]["floor:flex@256"]  # the floors: flex runs on the CPU
    assert (out / "summary.md").read_text().startswith("GPU check on CPU")


@pytest.mark.parametrize("argv,says", [(["tempreature"], "unknown argument tempreature (accepted: temperature, "
                                        "search, heal, --dry-run, --stage)"),
                                       (["--dry-run"], "name a study: temperature, search or heal")])
def test_the_gpu_study_refuses_a_wrong_call_in_one_line(argv, says, tmp_path):
    """A wrong argument costs a GPU call nothing but one line: the script stops before staging or installing."""
    done = subprocess.run(["bash", str(REPO / "eval" / "gpu_study.sh"), *argv], capture_output=True, text=True,
                          env={**os.environ, "OUT": str(tmp_path / "out")}, timeout=60)
    assert done.returncode == 2 and done.stderr.strip() == f"gpu_study.sh: {says}"
    assert not (tmp_path / "out").exists()
