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


def pack_three_groups(tmp_path: Path) -> tuple[list[Path], list[Path]]:
    """hfpatch's wheels (7 + 60 bytes of payload), SmolLM2's GGUF (25 bytes) and FlashAttention-4's wheels packed
    into parts of 100 bytes: (the files, the parts)."""
    src = tmp_path / "src"
    src.mkdir()
    files = [fake_wheel(src, "flash-attn-4", "4.0.0b36", b"fa4" * 60), fake_wheel(src, "gguf", "0.19.0",
                                                                                   bytes(range(7))),
             src / "m.gguf", fake_wheel(src, "transformers", "5.24.0", bytes(range(60)))]
    files[2].write_bytes(bytes(range(25)))
    return files, gpu_check.pack(files, tmp_path / "parts", part_size=100)


def carry(parts: Path, carried: Path, i: str, part: bytes | None = None) -> None:
    """One call's carried part, copied from `parts` into `carried` (or `part`, the bytes it arrives with)."""
    (carried / i).mkdir(parents=True, exist_ok=True)
    (carried / i / "part").write_bytes(part if part is not None else (parts / i / "part").read_bytes())
    (carried / i / "MANIFEST.json").write_bytes((parts / i / "MANIFEST.json").read_bytes())


def test_the_stream_holds_hfpatchs_wheels_then_the_model_then_fa4(tmp_path):
    """Whatever order the files come in, the studies' groups come first in the stream, FlashAttention-4's last."""
    files, made = pack_three_groups(tmp_path)
    manifest = json.loads((made[0] / "MANIFEST.json").read_text())
    assert [e["group"] for e in manifest["files"]] == ["wheels", "wheels", "model", "fa4"]
    assert [e["name"] for e in manifest["files"]] == [files[i].name for i in (1, 3, 2, 0)]
    assert manifest["part_bytes"] == 100 and manifest["parts"] == len(made) == -(-manifest["bytes"] // 100)


def test_a_studys_groups_join_from_the_first_parts_alone(tmp_path):
    """A study installs hfpatch's wheels and reads the model: the parts that hold them are the first ones, and once
    those are staged the two groups join (each file checked against its SHA-256), FlashAttention-4's parts still
    to come."""
    files, made = pack_three_groups(tmp_path)
    manifest = json.loads((made[0] / "MANIFEST.json").read_text())
    study = gpu_check.parts_of(manifest, ["wheels", "model"])
    fa4 = gpu_check.parts_of(manifest, ["fa4"])
    assert study == list(range(1, len(study) + 1)) and fa4[-1] == len(made) > study[-1]
    parts, staged, carried = tmp_path / "parts", tmp_path / "staged", tmp_path / "carried"
    for i in study[:-1]:
        carry(parts, carried, str(i))
        assert not gpu_check.stage(carried, staged)["complete"]
        assert gpu_check.staged_files(staged, "model") == []  # the model's last bytes are in the study's last part
    carry(parts, carried, str(study[-1]))
    result = gpu_check.stage(carried, staged)
    assert not result["complete"] and result["groups"]["wheels"] == result["groups"]["model"] == []
    assert result["groups"]["fa4"] == [i for i in fa4 if i > study[-1]]
    assert [f.read_bytes() for f in gpu_check.staged_files(staged, "wheels")] == [files[1].read_bytes(),
                                                                                  files[3].read_bytes()]
    assert [f.read_bytes() for f in gpu_check.staged_files(staged, "model")] == [bytes(range(25))]
    assert gpu_check.staged_files(staged, "fa4") == []
    for i in fa4:  # the check, later in the same warm session: the remaining parts
        carry(parts, carried, str(i))
    assert gpu_check.stage(carried, staged)["complete"]
    assert [f.read_bytes() for f in gpu_check.staged_files(staged, "fa4")] == [files[0].read_bytes()]


def test_a_missing_part_is_named(tmp_path, capsys):
    """A group whose parts are not all carried gives no files, and the command says which parts it needs."""
    _, made = pack_three_groups(tmp_path)
    manifest = json.loads((made[0] / "MANIFEST.json").read_text())
    parts, staged, carried = tmp_path / "parts", tmp_path / "staged", tmp_path / "carried"
    for i in gpu_check.parts_of(manifest, ["wheels", "model"])[1:]:  # all but the first
        carry(parts, carried, str(i))
    gpu_check.stage(carried, staged)
    assert gpu_check.missing_parts(staged, ["wheels"]) == [1]
    assert gpu_check.main(["staged", "--staged", str(staged), "--group", "wheels", "model"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and f"wheels needs parts 1 of {len(made)}, not carried yet" in err
    assert gpu_check.main(["stage", "--parts", str(carried), "--staged", str(staged), "--group", "wheels",
                           "model"]) == 1
    assert "wheels waits for parts 1;" in capsys.readouterr().err


def test_a_corrupted_or_foreign_part_is_not_joined(tmp_path):
    """A part whose bytes differ leaves its files out (SHA-256) until it is carried again; a part of another pack
    replaces what was staged instead of mixing with it."""
    files, made = pack_three_groups(tmp_path)
    parts, staged, carried = tmp_path / "parts", tmp_path / "staged", tmp_path / "carried"
    for p in made:
        carry(parts, carried, p.name, b"x" * (parts / p.name / "part").stat().st_size)
    result = gpu_check.stage(carried, staged)
    assert not result["complete"] and result["missing"] == [] and len(result["bad"]) == len(files)
    assert all(gpu_check.staged_files(staged, g) == [] for g in gpu_check.GROUPS)
    for p in made:
        carry(parts, carried, p.name)
    assert gpu_check.stage(carried, staged)["complete"]
    other = gpu_check.pack(files[1:2], tmp_path / "other", part_size=1000)  # one part
    carried2 = tmp_path / "carried2"
    carry(tmp_path / "other", carried2, other[0].name)
    result = gpu_check.stage(carried2, staged)
    assert result["missing"] == [] and set(result["groups"]) == {"wheels"}
    assert [f.read_bytes() for f in gpu_check.staged_files(staged, "wheels")] == [files[1].read_bytes()]
    assert gpu_check.staged_files(staged, "model") == []


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
