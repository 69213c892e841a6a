"""The hfpatch command: describe, patch --out, and one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest
from conftest import logits, max_diff, tiny_model, tokens

import hfpatch
from hfpatch.cli import main


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "tiny"
    hfpatch.save_pretrained(tiny_model("llama"), path)
    return path


def test_describe(saved, capsys):
    assert main(["describe", str(saved)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == "llama" and info["position"]["scheme"] == "rope"


def test_patch_writes_a_model_that_reloads(saved, tmp_path, capsys):
    out = tmp_path / "yarn"
    assert main(["patch", str(saved), "--position", "yarn", "--factor", "4", "--beta-fast", "16",
                 "--out", str(out)]) == 0
    assert "yarn:4" in capsys.readouterr().out
    loaded = hfpatch.from_pretrained(out)
    expected = hfpatch.patch(tiny_model("llama"), position="yarn", factor=4, beta_fast=16)
    x = tokens(160)
    assert max_diff(logits(loaded, x), logits(expected, x)) == 0.0


def test_opt_passes_json_values(saved, tmp_path):
    out = tmp_path / "lr"
    short, long = [1.0] * 8, [2.0] * 8
    assert main(["patch", str(saved), "--position", "longrope", "--factor", "4", "--opt", f"short_factor={short}",
                 "--opt", f"long_factor={long}", "--out", str(out)]) == 0
    assert hfpatch.from_pretrained(out).config.rope_parameters["long_factor"] == long


def test_supported(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HFPATCH_CACHE", str(tmp_path))
    assert main(["supported", "gemma3_text", "gpt2"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert sorted(info) == ["gemma3_text", "gpt2"]
    assert "yarn" in info["gemma3_text"]["patches"]["position"] and "yarn" not in info["gpt2"]["patches"]["position"]
    assert main(["supported", "gpt2", "--markdown"]) == 0  # read from the cache written above
    out = capsys.readouterr().out
    schemes = ", ".join(sorted(info["gpt2"]["patches"]["position"]))  # the Markdown row lists what the JSON measured
    assert out.startswith("| model type |") and f"| gpt2 | {schemes} |" in out and "alibi, interpolate, nope" in out
    assert list((tmp_path / "supported").glob("*.json"))
    assert main(["supported", "no_such_family"]) == 2
    assert "not a causal-LM model type" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["patch", "SAVED", "--position", "yarn", "--factor", "1", "--out", "X"], "factor must be > 1"),
    (["patch", "SAVED", "--position", "yarm", "--factor", "2", "--out", "X"], "unknown position scheme 'yarm'"),
    (["patch", "SAVED", "--position", "yarn", "--factor", "two", "--out", "X"], "invalid float value"),
    (["patch", "SAVED", "--position", "yarn", "--factor", "2"], "the following arguments are required: --out"),
    (["describe", "/no/such/folder"], "not a model folder"),
    (["describe", "missing.gguf"], "no such GGUF file"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_input_is_one_line_and_exit_2(saved, tmp_path, capsys, argv, message):
    argv = [str(saved) if a == "SAVED" else str(tmp_path / "x") if a == "X" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1


def test_rope_scheme_on_gpt2_from_the_command_line(tmp_path, capsys):
    path = tmp_path / "gpt2"
    hfpatch.save_pretrained(tiny_model("gpt2"), path)
    assert main(["patch", str(path), "--position", "yarn", "--factor", "2", "--out", str(tmp_path / "o")]) == 2
    assert "no RoPE" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_console_entry_point_exit_code(tmp_path):
    """The installed command path (python -m hfpatch), as a separate process."""
    proc = subprocess.run([sys.executable, "-m", "hfpatch", "patch", str(tmp_path), "--position", "ntk", "--factor",
                           "nan", "--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["hfpatch: error: factor must be finite, got nan"]


def test_norm_and_placement_from_the_command_line(tmp_path, capsys):
    src, out = tmp_path / "gpt2", tmp_path / "rms"
    hfpatch.save_pretrained(tiny_model("gpt2"), src)
    assert main(["patch", str(src), "--norm", "rmsnorm", "--placement", "post", "--out", str(out)]) == 0
    assert "norm=rmsnorm" in capsys.readouterr().out
    expected = hfpatch.patch(tiny_model("gpt2"), norm="rmsnorm", placement="post")
    x = tokens(40)
    assert max_diff(logits(hfpatch.from_pretrained(out), x), logits(expected, x)) == 0.0
    assert main(["patch", str(src), "--norm", "rmsnorm", "--no-exact", "--out", str(tmp_path / "plain")]) == 0
    assert hfpatch.describe(hfpatch.from_pretrained(tmp_path / "plain"))["norm"]["exact"] is False
