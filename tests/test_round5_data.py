"""hfpatch patch --calibrate on text too short to calibrate on: refused in one line saying how many tokens of text
the files hold (the end-of-text tokens that join them not counted) and the fewest a calibration takes."""

from __future__ import annotations

import pytest
from test_norms_2025 import llama_with_tokenizer

from hfpatch.cli import main
from hfpatch.lm.text import Document, joined_ids


@pytest.mark.parametrize("text, tokens", [("", 0), ("a", 1)])
def test_calibrate_refuses_text_too_short_and_counts_its_tokens_without_the_joiner(tmp_path, tiny_tokenizer_dir,
                                                                                  capsys, text, tokens):
    """An empty file holds 0 tokens (not 1: the end-of-text token after it is not text), a 1-character file 1 (and
    was fitted on, with the joiner as its second token)."""
    src, file = tmp_path / "llama", tmp_path / "text.txt"
    llama_with_tokenizer(src, tiny_tokenizer_dir)
    file.write_text(text)
    capsys.readouterr()
    assert main(["patch", str(src), "--norm", "dyt", "--calibrate", str(file), "--out", str(tmp_path / "x")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert errors == [f"hfpatch: error: --calibrate {file}: the text holds {tokens} token(s) (the end-of-text tokens "
                      "joining the files not counted); calibrating needs at least 2"]
    assert not (tmp_path / "x").exists()


def test_joined_text_ids_counts_the_documents_own_ids(tiny_tokenizer_dir):
    """The count against the ids joined_ids gives: every id but the EOS after each document, within the cut."""
    from transformers import AutoTokenizer

    from hfpatch.lm.text import joined_text_ids

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    docs = [Document(name, text) for name, text in [("a", "hello there"), ("b", ""), ("c", "more text here")]]
    own = [len(tok(d.text)["input_ids"]) for d in docs]
    ids, count = joined_text_ids(tok, docs)
    assert ids.tolist() == joined_ids(tok, docs).tolist() and len(ids) == sum(own) + len(docs)
    assert count == sum(own)
    # the first document and its EOS, the EOS of the empty second one, one id of the third
    ids, count = joined_text_ids(tok, docs, own[0] + 3)
    assert len(ids) == own[0] + 3 and count == own[0] + 1
