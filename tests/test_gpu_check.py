"""The prepared GPU check (eval/gpu_check.sh): its dry run on the CPU runs every step's code on tiny shapes, so the
script cannot rot between GPU runs; the model travels in parts and is joined only when whole and unchanged; the
perplexity comparison flags a cell outside the bf16 tolerance."""

import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from eval import gpu_check

REPO = Path(__file__).resolve().parent.parent


def fake_wheel(folder: Path, name: str, version: str, payload: bytes) -> Path:
    """A wheel file with the metadata gpu_check reads, and some payload."""
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", f"Name: {name}\nVersion: {version}\n\n")
        z.writestr("payload.bin", payload)
    return path


def test_the_staged_files_are_joined_only_when_every_part_is_there_and_unchanged(tmp_path):
    """The wheels (hfpatch's and FlashAttention-4's) and the GGUF travel as one byte stream in parts, one carried per
    call; the files come back, each in its group, only when every part is there and every file's SHA-256 agrees."""
    src = tmp_path / "src"
    src.mkdir()
    files = [fake_wheel(src, "gguf", "0.19.0", bytes(range(7))),
             fake_wheel(src, "flash-attn-4", "4.0.0b36", b"fa4" * 9), src / "m.gguf"]
    files[2].write_bytes(bytes(range(25)))
    parts = tmp_path / "parts"
    made = gpu_check.pack(files, parts, part_size=100)
    total = sum(f.stat().st_size for f in files)
    assert [p.name for p in made] == [str(i) for i in range(1, -(-total // 100) + 1)] and len(made) >= 3
    staged, carried = tmp_path / "staged", tmp_path / "carried"

    def carry(i: str, part: bytes | None = None) -> None:  # one call's carried part
        (carried / i).mkdir(parents=True, exist_ok=True)
        (carried / i / "part").write_bytes(part if part is not None else (parts / i / "part").read_bytes())
        (carried / i / "MANIFEST.json").write_bytes((parts / i / "MANIFEST.json").read_bytes())

    carry("1")
    carry(made[-1].name)
    first = gpu_check.stage(carried, staged)
    assert not first["complete"] and first["missing"] == [int(p.name) for p in made[1:-1]]
    assert gpu_check.staged_files(staged, "model") == []
    for p in made[1:-1]:
        carry(p.name, b"x" * 100)  # corrupted parts
    assert not gpu_check.stage(carried, staged)["complete"]
    assert gpu_check.staged_files(staged, "wheels") == []
    for p in made[1:-1]:
        carry(p.name)
    assert gpu_check.stage(carried, staged)["complete"]
    assert [f.read_bytes() for f in gpu_check.staged_files(staged, "model")] == [bytes(range(25))]
    assert [f.name for f in gpu_check.staged_files(staged, "fa4")] == [files[1].name]
    assert [f.read_bytes() for f in gpu_check.staged_files(staged, "wheels")] == [files[0].read_bytes()]
    assert gpu_check.stage(carried, staged)["detail"] == "staged already"  # a later call: nothing joined again


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
    assert set(steps) >= {"wheels", "stage", "tests", "bench-infer", "bench-train", "recipe", "ppl"}, \
        proc.stdout[-3000:]
    if (REPO / ".whl").is_dir():  # bash eval/gpu_wheels.sh was run here
        assert steps["wheels"]["status"] == "ok", proc.stdout[-3000:]
    if (REPO / ".gpu-stage").is_dir():
        assert steps["stage"]["status"] == "ok", proc.stdout[-3000:]
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
