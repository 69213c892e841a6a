"""Defects found by using the `hfpatch` command and the Python API as a new user would (issue 15, item 4): each
was a silent success or a traceback, and is now one clear error."""

import pytest
from conftest import tiny_model

import hfpatch
from hfpatch.cli import main


@pytest.fixture
def folder(tmp_path):
    path = tmp_path / "model"
    hfpatch.save_pretrained(tiny_model("llama"), path)
    return path


def test_patch_without_any_patch_is_an_error_not_a_copy(folder, tmp_path, capsys):
    assert main(["patch", str(folder), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "nothing to patch: give --position, --norm, --placement, --attention-temperature or --spec-file" in err
    assert not (tmp_path / "out").exists()


def test_saving_onto_a_file_is_an_error_not_a_silent_no_op(folder, tmp_path, capsys):
    target = tmp_path / "notes.txt"
    target.write_text("keep me")
    assert main(["patch", str(folder), "--out", str(target), "--position", "yarn", "--factor", "2"]) == 2
    assert f"{target} is a file, not a folder" in capsys.readouterr().err
    with pytest.raises(ValueError, match="is a file, not a folder"):
        hfpatch.save_pretrained(tiny_model("llama"), target)
    assert target.read_text() == "keep me"


def test_paths_may_start_with_a_tilde(folder, tmp_path, monkeypatch):
    """YAML does not expand ~ (a shell does): output_dir: ~/runs/x used to make a folder named '~' in the current
    folder, and data/model paths under ~ were 'not found'."""
    from hfpatch.train.config import load

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "books").mkdir()
    (tmp_path / "books" / "a.txt").write_text("text")
    cfg = load("heal", None, ["model=~/model", "data.text_files=[~/books]", "output_dir=~/runs/x",
                              "tokenizer=~/tok", "resume=~/runs/x/checkpoints/step_2"])
    assert cfg.output_dir == str(tmp_path / "runs" / "x") and cfg.data.text_files == [str(tmp_path / "books")]
    assert cfg.model == str(tmp_path / "model") and cfg.tokenizer == str(tmp_path / "tok")
    assert cfg.resume == str(tmp_path / "runs" / "x" / "checkpoints" / "step_2")
    from hfpatch.models import load as load_model

    model, _ = load_model(f"~/{folder.relative_to(tmp_path)}")
    assert type(model).__name__ == "LlamaForCausalLM"
