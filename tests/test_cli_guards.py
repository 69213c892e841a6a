"""The hfpatch command writes a patched model whole or not at all, never over its own source, and turns what used to
be tracebacks (a --out under a file, a full disk, a pickle that torch refuses, a results file that is not UTF-8) into
one line and exit code 2."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from safetensors import SafetensorError
from test_eval_perplexity import save_tiny, text_of

import hfpatch
from hfpatch.cli import main
from hfpatch.evaluate.results import Results
from hfpatch.utils.files import Lock

pytestmark = pytest.mark.usefixtures("own_cache")


def cli(capsys, *argv):
    """(exit code, the error line); more than one error line fails."""
    capsys.readouterr()
    code = main(list(argv))
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]  # not progress bars
    assert len(errors) <= 1, errors
    return code, errors[0] if errors else ""


@pytest.fixture
def model(tmp_path):
    return save_tiny(tmp_path / "model")


def _disk_full(error):
    """safetensors' save_file that writes part of its file, then fails as a full disk does (safetensors reports it
    as a SafetensorError, not an OSError)."""
    def full(tensors, filename, *args, **kwargs):
        Path(filename).write_bytes(b"half a file")
        raise error
    return full


FULL = [OSError(errno.ENOSPC, "No space left on device"),
        SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")]


@pytest.mark.parametrize("error", FULL, ids=["OSError", "SafetensorError"])
def test_a_full_disk_leaves_no_half_written_model_under_the_real_name(model, tmp_path, capsys, monkeypatch, error):
    import transformers.modeling_utils as modeling_utils

    monkeypatch.setattr(modeling_utils, "safe_save_file", _disk_full(error))
    out = tmp_path / "patched"
    code, err = cli(capsys, "patch", str(model), "--position", "ntk", "--factor", "2", "--out", str(out))
    assert code == 2 and f"could not write {out}: no space left on the device" in err, err
    assert not out.exists() and not (tmp_path / "patched.partial").exists()


def test_a_second_patch_into_a_locked_out_is_refused_with_the_holders_pid(model, tmp_path, capsys):
    """Two runs into one --out would share OUT.partial: the second is refused, naming the first's process."""
    out = tmp_path / "patched"
    with Lock(tmp_path / "patched.lock", "another run"):
        code, err = cli(capsys, "patch", str(model), "--position", "ntk", "--factor", "2", "--out", str(out))
    assert code == 2 and f"--out {out} is in use by another run (process {os.getpid()})" in err, err
    assert not out.exists() and not (tmp_path / "patched.partial").exists()
    assert cli(capsys, "patch", str(model), "--position", "ntk", "--factor", "2", "--out", str(out))[0] == 0


def test_a_full_disk_while_results_json_is_written_keeps_the_previous_file(tmp_path, monkeypatch):
    """The results file's write fails half-way: one error naming the file and the full disk, the previous complete
    file as it was, and no results.json.<pid>.tmp left."""
    path = tmp_path / "results.json"
    results = Results(path, "ppl", {"model": "m"}, "documents", lambda records: {"n": len(records)})
    results.save()
    before = path.read_bytes()
    real = Path.write_text

    def filling(self, text, *args, **kwargs):
        real(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", filling)
    results.data["cells"].append({"patch": "none", "documents": [], "complete": False})
    with pytest.raises(ValueError, match=f"could not write {path}: no space left on the device"):
        results.save()
    monkeypatch.undo()
    results.close()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]  # no tmp file; the lock released


def test_a_full_disk_keeps_the_model_that_was_at_out(model, tmp_path, capsys, monkeypatch):
    import transformers.modeling_utils as modeling_utils

    out = tmp_path / "patched"
    assert cli(capsys, "patch", str(model), "--position", "ntk", "--factor", "2", "--out", str(out))[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(modeling_utils, "safe_save_file",
                        lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
    assert cli(capsys, "patch", str(model), "--position", "yarn", "--factor", "4", "--out", str(out))[0] == 2
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_out_inside_a_file_is_one_error(model, tmp_path, capsys):
    (tmp_path / "file.txt").write_text("x")
    code, err = cli(capsys, "patch", str(model), "--position", "ntk", "--factor", "2", "--out",
                    str(tmp_path / "file.txt" / "sub"))
    assert code == 2 and "is a file" in err, err


def test_out_equal_to_the_source_folder_is_refused(model, capsys):
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    code, err = cli(capsys, "patch", str(model), "--position", "ntk", "--factor", "2", "--out", str(model) + "/")
    assert code == 2 and "the model's own folder" in err, err
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before


def test_out_that_is_a_folder_of_other_things_is_refused(model, tmp_path, capsys):
    """--out names a folder that holds something other than a model: refused rather than replaced."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    code, err = cli(capsys, "patch", str(model), "--position", "ntk", "--factor", "2", "--out", str(out))
    assert code == 2 and "holds notes.txt, and is not a model hfpatch saved" in err and "--overwrite" in err, err
    assert (out / "notes.txt").read_text() == "keep me"


# Files that are not part of a saved model, put beside one: a trainer's checkpoint, state and arguments, notes, a
# GGUF export
EXTRAS = {"checkpoint-500/optimizer.pt": b"optimizer state", "NOTES.txt": b"my notes",
          "trainer_state.json": b'{"global_step": 500}', "training_args.bin": b"trainer arguments",
          "model.Q4_K_M.gguf": b"GGUF my own export"}


def _put_extras(folder: Path) -> None:
    for name, content in EXTRAS.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(content)


def _extras_in(folder: Path) -> dict:
    return {name: (folder / name).read_bytes() for name in EXTRAS if (folder / name).is_file()}


def _files(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_patch_into_a_model_folder_keeps_the_files_that_are_not_the_model(model, tmp_path, capsys):
    """hfpatch patch --out onto a model hfpatch saved replaces its model files, never what sits beside them."""
    out = tmp_path / "patched"
    assert cli(capsys, "patch", str(model), "--position", "yarn", "--factor", "2", "--out", str(out))[0] == 0
    _put_extras(out)
    (out / "model-00001-of-00002.safetensors").write_bytes(b"a shard of an older save")  # a stale model file
    assert cli(capsys, "patch", str(model), "--position", "ntk", "--factor", "4", "--out", str(out))[0] == 0
    assert _extras_in(out) == EXTRAS
    assert not (out / "model-00001-of-00002.safetensors").exists()
    assert hfpatch.describe(hfpatch.from_pretrained(out))["applied"]["position"]["scheme"] == "ntk"
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_a_model_folder_hfpatch_did_not_save_needs_overwrite_and_keeps_its_other_files(model, tmp_path, capsys):
    """A trainer's output folder (config.json, weights, notes, checkpoints): refused without --overwrite, naming what
    is there; with it, the model files are replaced and the rest stays."""
    out = tmp_path / "run"
    tiny_model("llama").save_pretrained(out)  # transformers' own save: no hfpatch section, no card
    _put_extras(out)
    before = _files(out)
    code, err = cli(capsys, "patch", str(model), "--position", "ntk", "--factor", "2", "--out", str(out))
    assert code == 2 and "holds NOTES.txt, checkpoint-500" in err and "--overwrite" in err, err
    assert _files(out) == before
    assert cli(capsys, "patch", str(model), "--position", "ntk", "--factor", "2", "--out", str(out),
               "--overwrite")[0] == 0
    assert _extras_in(out) == EXTRAS
    assert hfpatch.describe(hfpatch.from_pretrained(out))["applied"]["position"]["scheme"] == "ntk"


def test_a_failed_move_into_out_keeps_the_old_model_and_the_other_files(model, tmp_path, capsys, monkeypatch):
    """The new model's files are moved into OUT one by one: a failure half-way puts back what was moved, so OUT
    holds the old model and everything else it held, byte for byte."""
    from hfpatch.utils import files

    out = tmp_path / "patched"
    assert cli(capsys, "patch", str(model), "--position", "yarn", "--factor", "2", "--out", str(out))[0] == 0
    _put_extras(out)
    before = _files(out)
    real = os.rename

    def failing(src, dst):
        if Path(src) == tmp_path / "patched.partial" / "model.safetensors":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(files.os, "rename", failing)
    code, err = cli(capsys, "patch", str(model), "--position", "ntk", "--factor", "4", "--out", str(out))
    assert code == 2 and f"could not write {out}: no space left on the device" in err, err
    assert _files(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["model", "patched"]


def test_save_pretrained_into_a_folder_keeps_the_files_that_are_not_the_model(tmp_path):
    """hfpatch.save_pretrained from Python writes the model's files into the folder and leaves the rest."""
    out = tmp_path / "model"
    hfpatch.save_pretrained(tiny_model("llama"), out)
    _put_extras(out)
    hfpatch.save_pretrained(hfpatch.patch(tiny_model("llama"), position="ntk", factor=2.0), out)
    assert _extras_in(out) == EXTRAS


class Payload:
    def __reduce__(self):
        return (print, ("ran",))


def test_a_pickle_torch_refuses_is_one_error_with_allow_pickled_weights(tmp_path, capsys):
    path = tmp_path / "pickled"
    hfpatch.save_pretrained(tiny_model("llama"), path)
    (path / "model.safetensors").unlink()
    torch.save({"x": Payload()}, path / "pytorch_model.bin")
    code, err = cli(capsys, "describe", str(path), "--allow-pickled-weights")
    assert code == 2 and err, err
    assert "pytorch_model.bin" in err and "refused" in err, err


def test_a_results_file_that_is_not_utf8_is_named(model, tmp_path, capsys):
    (tmp_path / "a.txt").write_text(text_of(200, 1), encoding="utf-8")
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_bytes(b'{"kind": "perplexity", "x": "\xff\xfe"}')
    code, err = cli(capsys, "eval", "ppl", "--model", str(model), "--text-files", str(tmp_path / "a.txt"),
                    "--lengths", "32", "--no-plot", "--out", str(out))
    assert code == 2 and err, err
    assert str(out / "results.json") in err and "UTF-8" in err and "--overwrite" in err, err


def test_an_eval_out_inside_a_file_is_one_error(model, tmp_path, capsys):
    (tmp_path / "a.txt").write_text(text_of(200, 1), encoding="utf-8")
    (tmp_path / "file.txt").write_text("x")
    code, err = cli(capsys, "eval", "ppl", "--model", str(model), "--text-files", str(tmp_path / "a.txt"),
                    "--lengths", "32", "--no-plot", "--out", str(tmp_path / "file.txt" / "sub"))
    assert code == 2 and "file.txt" in err and "cannot create" in err, err


@pytest.mark.slow  # a subprocess that imports torch
def test_a_reader_that_stops_early_gets_no_traceback():
    """`hfpatch supported | head -1`: the closed pipe ends the command quietly (exit 1), without a traceback."""
    import subprocess
    import sys

    proc = subprocess.run(f"'{sys.executable}' -m hfpatch supported | head -c 10", shell=True,
                          capture_output=True, text=True, timeout=300)
    assert len(proc.stdout) == 10
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
