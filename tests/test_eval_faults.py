"""Evaluations killed anywhere lose nothing: SIGKILL inside the results-file write (half written, written but not
renamed: eval ppl), right after it or at a random moment (eval passkey); resumed, the results equal an
uninterrupted run's. A truncated
or hand-edited results file is refused with what is wrong and how to recover, never used. Two runs cannot write
the same file. (eval/soak_eval_kills.py runs many more kills through the same functions.)"""

from __future__ import annotations

import fcntl
import json
import os
import random

import pytest
import torch
from conftest import REPO

from eval import soak_eval_kills as soak
from hfpatch.cli import main as cli_main
from hfpatch.evaluate.evaluations import ppl as perplexity
from hfpatch.evaluate.results import comparable as strip_timing
from hfpatch.tiny import char_text as text_of
from hfpatch.tiny import char_tokenizer, sized_model
from hfpatch.tiny import save_sized as save_tiny
from hfpatch.utils.files import Lock, Locked


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.setenv("HFPATCH_CACHE", str(tmp_path / "cache"))
    model = save_tiny(tmp_path / "model")
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(4):
        (docs / f"d{i}.txt").write_text(text_of(100, i), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HFPATCH_CACHE": str(tmp_path / "cache")}
    return model, docs, env


def _kill_test(command, tmp_path, env, faults):
    assert cli_main([*command, "--out", str(tmp_path / "whole")]) == 0  # the uninterrupted run, in process
    whole = json.loads((tmp_path / "whole" / "results.json").read_text())
    out = tmp_path / "killed"
    got = soak.kill_and_resume([*command, "--out", str(out)], out, faults, env, soak.saves_of(whole))
    assert [r["killed"] for r in got["runs"]] == [True] * len(faults), got["runs"]  # every fault did kill a run
    assert not got["leftover_tmp"]  # the half-written temporary files were cleared by the runs that resumed
    for run in (r for r in got["runs"] if r["mode"] == "full"):  # a full disk: one line, exit 2, its file removed
        assert run["one_line"] and not run["tmp_left"], run
    assert len(got["final"]["runs"]) >= 2  # it was resumed (each run that got to work appends itself)
    assert strip_timing(got["final"]) == strip_timing(whole)


def test_ppl_killed_anywhere_resumes_to_the_same_results(setup, tmp_path):
    model, docs, env = setup
    command = ["eval", "ppl", "--model", str(model), "--text-files", str(docs), "--lengths", "16,32",
               "--patches", "none,ntk:2", "--no-plot"]
    _kill_test(command, tmp_path, env, [("half", 0.3), ("full", 0.5), ("before", 0.6)])


def test_passkey_killed_anywhere_resumes_to_the_same_results(setup, tmp_path):
    model, _, env = setup
    command = ["eval", "passkey", "--model", str(model), "--lengths", "300,400", "--depths", "0,1", "--trials", "2",
               "--patches", "none,ntk:2", "--new-tokens", "4", "--no-plot"]
    _kill_test(command, tmp_path, env, [("after", 0.4), ("random", 0.0)])


def _finished_ppl(setup, tmp_path):
    model, docs, _ = setup
    argv = ["--model", str(model), "--text-files", str(docs), "--lengths", "16", "--patches", "none,ntk:2",
            "--no-plot", "--out", str(tmp_path / "r")]
    assert perplexity.main(argv) == 0
    return argv, tmp_path / "r" / "results.json"


@pytest.mark.parametrize("damage,message", [
    (lambda t: t[: len(t) // 2], "not valid JSON"),
    (lambda t: t.replace('"nll_sum": ', '"nll_sum": 1 + ', 1), "not valid JSON"),
    (lambda t: "[]", "not an hfpatch results file"),
    (lambda t: _edit(t, lambda d: d["cells"][0]["documents"][1].update(nll_sum=1.0)), "nll_sum, ppl differ"),
    (lambda t: _edit(t, lambda d: d["cells"][1].update(ppl=2.0)), "ppl differ from what its documents give"),
    (lambda t: _edit(t, lambda d: d["cells"][0]["documents"][0].pop("bytes")), "cannot be summarized"),
    (lambda t: _edit(t, lambda d: d["cells"][0].update(complete="yes")), "'complete' is 'yes'"),
    (lambda t: _edit(t, lambda d: d["cells"][0].update(documents=None)), "has no list of documents"),
])
def test_damaged_results_file_is_refused_with_how_to_recover(setup, tmp_path, capsys, damage, message):
    argv, path = _finished_ppl(setup, tmp_path)
    path.write_text(damage(path.read_text()))
    capsys.readouterr()
    assert perplexity.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err and "--overwrite" in err, err
    assert perplexity.main([*argv, "--overwrite"]) == 0  # the way out it names works


def _edit(text, change):
    data = json.loads(text)
    change(data)
    return json.dumps(data)


def test_a_second_run_cannot_write_the_same_results(setup, tmp_path, capsys):
    argv, path = _finished_ppl(setup, tmp_path)
    with open(path.with_name("results.json.lock"), "w") as held:  # as a run in progress holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert perplexity.main(argv) == 2
        assert "another run is writing" in capsys.readouterr().err
    stale = path.with_name("results.json.12345.tmp")
    stale.write_text("{half")
    assert perplexity.main(argv) == 0 and not stale.exists()  # a killed run's temporary file is cleared


def test_a_finished_run_removes_its_lock_file(setup, tmp_path):
    _, path = _finished_ppl(setup, tmp_path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["results.json", "table.md"]


def test_a_lock_taken_on_a_removed_lock_file_does_not_count(tmp_path, monkeypatch):
    """The holder removes the lock file as it releases it: a run that opened that file just before, and locks it
    just after, must not count itself the holder (a third run would lock a new file of the same name): it tries
    again on the file the name gives now."""
    path = tmp_path / "results.json.lock"
    first = Lock(path, "x")
    real_open, opened = open, []

    def open_then_release(file, mode="r", *a, **k):  # the first holder releases between our open and our flock
        f = real_open(file, mode, *a, **k)
        opened.append(f)
        if len(opened) == 1:
            first.close()
        return f

    monkeypatch.setattr("builtins.open", open_then_release)
    second = Lock(path, "x")
    monkeypatch.undo()
    assert len(opened) == 2 and opened[0].closed  # the removed file was given up, the new one locked
    assert os.stat(path).st_ino == os.fstat(opened[1].fileno()).st_ino
    with pytest.raises(Locked):
        Lock(path, "x")  # the second run holds the file the name gives
    second.close()
    assert not path.exists()


def test_fault_plan_is_reproducible():
    assert soak.random_faults(random.Random(1), 8) == soak.random_faults(random.Random(1), 8)
    assert {m for m, _ in soak.random_faults(random.Random(1), 8)} == set(soak.MODES)


def _strict_json(text: str):
    """json.loads that refuses NaN and Infinity, as every JSON reader outside Python does."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_nan_loss_is_stored_as_null_resumes_and_shows_as_nan(setup, tmp_path, capsys):
    """A model whose loss is NaN: the results file is strict JSON (null, not a bare NaN), the same command
    continues it instead of calling it damaged, and the table says nan (not inf, which is an overflowed
    perplexity)."""
    _, docs, _ = setup
    model = sized_model("llama")
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")  # every logit NaN: the loss is NaN
    model.save_pretrained(tmp_path / "nan_model")
    char_tokenizer().save_pretrained(tmp_path / "nan_model")
    argv = ["--model", str(tmp_path / "nan_model"), "--text-files", str(docs), "--lengths", "16", "--no-plot",
            "--out", str(tmp_path / "r")]
    capsys.readouterr()
    assert perplexity.main([*argv, "--patches", "none"]) == 0
    data = _strict_json((tmp_path / "r" / "results.json").read_text())
    cell = data["cells"][0]
    assert cell["complete"] and cell["ppl"] is None and cell["mean_nll"] is None and cell["bpb"] is None
    assert all(d["nll_sum"] is None for d in cell["documents"])
    assert "| none | nan |" in capsys.readouterr().out

    assert perplexity.main([*argv, "--patches", "none,ntk:2"]) == 0  # continued, not refused as damaged
    captured = capsys.readouterr()
    assert "resuming from" in captured.err and "| ntk:2 | nan |" in captured.out, captured
    data = _strict_json((tmp_path / "r" / "results.json").read_text())
    assert [c["patch"] for c in data["cells"]] == ["none", "ntk:2"]

    # a file that holds bare NaN (Python's json writes it unless told not to) is read as null and continued too
    path = tmp_path / "r" / "results.json"
    path.write_text(path.read_text().replace('"nll_sum": null', '"nll_sum": NaN').replace('"mean_nll": null',
                                                                                          '"mean_nll": NaN'))
    assert perplexity.main([*argv, "--patches", "none,ntk:2,yarn:2"]) == 0, capsys.readouterr().err
    assert "| none | nan |" in capsys.readouterr().out
    assert _strict_json(path.read_text())["cells"][0]["mean_nll"] is None  # rewritten strictly


def test_the_table_tells_a_nan_loss_from_an_overflowed_perplexity():
    def cell(patch, mean_nll, bpb):  # an overflow has a finite mean NLL too large for exp(); a NaN loss has none
        return {"patch": patch, "windowing": "chunks", "length": 16, "complete": True, "ppl": None, "bpb": bpb,
                "mean_nll": mean_nll}

    data = {"cells": [cell("overflow", 800.0, 1154.2), cell("nan", None, None)],
            "settings": {"windowing": ["chunks"], "lengths": [16], "patches": ["overflow", "nan"]}}
    table = perplexity.EVALUATION.tables(data)
    assert "| overflow | inf |" in table and "| nan | nan |" in table, table
