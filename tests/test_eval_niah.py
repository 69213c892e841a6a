"""eval niah: the needle sits at the asked depth of the haystack (several needles evenly after it), prompts fit
their length, retrieval is scored by string match, the heatmap/table bookkeeping with an oracle in place of the
model, needle files are validated."""

from __future__ import annotations

import json
import re

import pytest
from conftest import cli_answered_by

from hfpatch.cli import main as cli_main
from hfpatch.evaluate import haystack as hs
from hfpatch.evaluate.evaluations import niah
from hfpatch.tiny import char_tokenizer as tiny_tokenizer
from hfpatch.tiny import save_sized as save_tiny


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HFPATCH_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def src():
    return hs.source(None)


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_needle_sits_at_the_asked_depth(src, depth):
    """The needle goes at `depth` of the haystack's length, moved back to the end of a sentence."""
    needles = niah.NEEDLE_SETS["sandwich"]
    s = niah.build(src, 1234, 2000, needles, depth)
    context = s.input.split("\n\nAnswer the question")[0]
    needle = needles["needles"][0]
    assert context.count(needle) == 1
    before, after = (part.strip() for part in context.split(needle))
    haystack = (before + " " + after).strip()
    units = hs.sentences(haystack)
    target = depth * len(haystack)
    assert len(before) <= target + 1e-9  # the needle is not past the depth ...
    if after:  # ... and the next sentence would end past it
        assert len(before) + 1 + len(hs.sentences(after)[0]) > target
    assert len(hs.sentences(before)) + len(hs.sentences(after)) == len(units) == s.facts["sentences"]


def test_several_needles_go_evenly_after_the_depth(src):
    needles = niah.NEEDLE_SETS["pizza"]
    s = niah.build(src, 99, 3000, needles, 0.4)
    context = s.input.split("\n\nAnswer the question")[0]
    assert s.facts["fractions"] == pytest.approx([0.4, 0.6, 0.8])
    haystack = context
    for needle in needles["needles"]:
        haystack = haystack.replace(needle + " ", "")
    for needle, f in zip(needles["needles"], (0.4, 0.6, 0.8)):
        before = context[: context.index(needle)]
        for other in needles["needles"]:
            before = before.replace(other + " ", "")
        assert len(before.strip()) <= f * len(haystack) < len(before) + len(hs.sentences(haystack[len(before):])[0])
    assert s.references == ["figs", "prosciutto", "goat cheese"] and s.answer_prefix.endswith("pizza are")


def test_cli_heatmap_table_and_scores(tmp_path, monkeypatch, capsys):
    """An oracle answers with the first half of the answers when the needle is in the first half of the prompt,
    else with nothing: the scores of every cell are known."""
    model_dir = save_tiny(tmp_path / "model")
    tok = tiny_tokenizer()

    def oracle(run, ids, new_tokens, eos, done=None):
        text = tok.decode(ids)
        first = text.index("Figs are one of") < len(text) / 2
        return tok(" figs and goat cheese" if first else " bread", add_special_tokens=False)["input_ids"]

    argv = ["eval", "niah", "--model", str(model_dir), "--needles", "pizza", "--lengths", "1500,2500",
            "--depths", "0,0.3,0.9", "--patches", "none,ntk:2", "--out", str(tmp_path / "n")]
    out = cli_answered_by(monkeypatch, capsys, oracle, argv)
    res = json.loads((tmp_path / "n" / "results.json").read_text())
    assert len(res["cells"]) == 2 * 2 * 3
    for c in res["cells"]:
        (t,) = c["trials"]
        assert t["prompt_tokens"] + 32 <= c["length"]
        assert t["score"] == c["score"] == (2 / 3 if c["depth"] < 0.5 else 0.0)
        assert t["found"] == ([True, False, True] if c["depth"] < 0.5 else [False, False, False])
    assert "| 0.3 | 0.67 | 0.67 |" in out and "| 0.9 | 0.00 | 0.00 |" in out
    assert (tmp_path / "n" / "niah.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("content,message", [
    ('{"needles": [], "question": "q", "answer_prefix": "a", "answers": ["x"]}', "an empty list"),
    ('{"needles": ["n"], "answers": ["x"]}', "question, answer_prefix"),
    ("{not json", "not valid JSON"),
])
def test_needle_files_are_validated(tmp_path, capsys, content, message):
    model_dir = save_tiny(tmp_path / "model")
    capsys.readouterr()
    (tmp_path / "n.json").write_text(content)
    assert cli_main(["eval", "niah", "--model", str(model_dir), "--needles", str(tmp_path / "n.json"),
                     "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err, err


def test_a_length_too_short_for_the_prompt_names_the_smallest_length_that_holds_it(tmp_path, capsys):
    """The limit is a positive number of tokens (it said "more than -22 tokens"): the prompt with the smallest
    haystack plus --new-tokens. That length runs; one token less is refused with the same limit."""
    model_dir = save_tiny(tmp_path / "model")

    def run(length):
        capsys.readouterr()
        code = cli_main(["eval", "niah", "--model", str(model_dir), "--lengths", str(length), "--depths", "0.5",
                         "--new-tokens", "8", "--dry-run", "--out", str(tmp_path / f"o{length}")])
        return code, capsys.readouterr().err.strip()

    code, err = run(10)
    assert code == 2 and "\n" not in err and "length 10 is too short" in err, err
    shortest = int(re.search(r"use lengths of at least (\d+)", err).group(1))
    assert shortest > 8 and "and 8 are generated (--new-tokens)" in err
    assert run(shortest - 1) == (2, err.replace("length 10 ", f"length {shortest - 1} "))
    assert run(shortest)[0] == 0


def test_own_needle_file_runs(tmp_path):
    spec = {"needles": ["The magic word is xylophone."], "question": "What is the magic word?",
            "answer_prefix": "The magic word is", "answers": ["xylophone"]}
    (tmp_path / "n.json").write_text(json.dumps(spec))
    assert niah.needle_set(str(tmp_path / "n.json")) == spec
    s = niah.build(hs.Source("One. Two. Three. Four."), 0, 4, spec, 0.5)
    assert "Two. The magic word is xylophone. Three." in s.input
