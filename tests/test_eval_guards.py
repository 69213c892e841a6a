"""Evaluations never give a silently wrong table: a results file is continued only with the model it was computed
with (by content, not by path), haystacks too short for a cell and needle files of the wrong shape are refused
before any work, and lengths whose memory cannot fit are refused before anything is built. (Kills and damaged
results files: tests/test_eval_faults.py.)"""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import tiny_model
from test_eval_perplexity import save_tiny, text_of, tiny_tokenizer

import hfpatch
from hfpatch.cli import main as cli_main


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HFPATCH_CACHE", str(tmp_path / "cache"))


def cli(capsys, *argv):
    capsys.readouterr()
    code = cli_main(list(argv))
    return code, capsys.readouterr().err.strip()


@pytest.fixture
def ppl(tmp_path):
    """A tiny model saved at a path, a text file, and the ppl command on them (without --patches)."""
    model = save_tiny(tmp_path / "model")
    (tmp_path / "a.txt").write_text(text_of(200, 1), encoding="utf-8")
    argv = ["eval", "ppl", "--model", str(model), "--text-files", str(tmp_path / "a.txt"), "--lengths", "32",
            "--no-plot", "--out", str(tmp_path / "out")]
    return model, argv


def test_resume_with_other_weights_at_the_same_path_is_refused(ppl, capsys):
    """Model A scored, model B copied to A's path, the run resumed into the same --out: refused, naming the
    weights file, instead of a table whose rows come from two models."""
    model, argv = ppl
    assert cli(capsys, *argv, "--patches", "none")[0] == 0
    shutil.rmtree(model)
    hfpatch.save_pretrained(tiny_model("llama", seed=1), model, tokenizer=tiny_tokenizer())
    code, err = cli(capsys, *argv, "--patches", "none,ntk:2")
    assert code == 2 and "\n" not in err, err
    assert "model_files/model.safetensors" in err and "--overwrite" in err
    results = json.loads((model.parent / "out" / "results.json").read_text())
    assert [c["patch"] for c in results["cells"]] == ["none"]  # nothing of B was added


def test_resume_with_another_config_is_refused(ppl, capsys):
    model, argv = ppl
    assert cli(capsys, *argv, "--patches", "none")[0] == 0
    config = json.loads((model / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 500.0  # same weights, other positions
    (model / "config.json").write_text(json.dumps(config))
    code, err = cli(capsys, *argv, "--patches", "none,ntk:2")
    assert code == 2 and "model_files/config.json" in err, err


def test_resume_with_the_same_model_copied_elsewhere_continues(ppl, capsys, tmp_path):
    """The identity is the content: the same files at another path (a copy, new mtimes) resume the run."""
    model, argv = ppl
    assert cli(capsys, *argv, "--patches", "none")[0] == 0
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    shutil.rmtree(model)
    copy.rename(model)
    code, err = cli(capsys, *argv, "--patches", "none,ntk:2")
    assert code == 0 and "resuming from" in err, err


def test_a_tokenizer_changed_in_place_is_not_served_stale_ids():
    """The tokenization cache is keyed by the tokenizer's full definition: a normalizer or a post-processor set on
    the same object (same vocabulary size) gives new ids, the ones an uncached tokenization gives."""
    from tokenizers import normalizers, processors

    from hfpatch.text import Document, tokenize

    tok = tiny_tokenizer()
    doc = Document("d", "Hello World. ABC")
    first = tokenize(tok, doc).ids
    tok.backend_tokenizer.normalizer = normalizers.Lowercase()
    lowered = tokenize(tok, doc).ids
    assert list(lowered) == list(tokenize(tok, doc, use_cache=False).ids) != list(first)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    framed = tokenize(tok, doc).ids
    assert list(framed) == list(tokenize(tok, doc, use_cache=False).ids) == [1, *lowered]
