"""hfpatch search on a tiny model (window 64, target 256): the same seed draws and scores the same candidates; the
budget (candidates, wall time) holds; a search killed with SIGKILL and resumed ends as an uninterrupted one; every
candidate keeps its family's constraints; LongRoPE's starting points reproduce the schemes they come from; the
objective scores the tokens it says it does; the best spec saves, reloads in plain transformers and exports to
GGUF; `hfpatch patch --spec-file` applies it."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, tiny_model
from transformers import AutoModelForCausalLM

import hfpatch
from hfpatch.cli import main as cli_main
from hfpatch.evaluate.results import comparable
from hfpatch.search import objective, space
from hfpatch.search import search as run_search
from hfpatch.search.options import Budget, parse_budget
from hfpatch.lm.text import Document
from hfpatch.tiny import char_text, char_tokenizer, save_sized

TARGET = 256
SMALL = {"population": 4, "parents": 2, "samples": 1, "progress": False, "plot": False}


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def docs():
    return [Document(f"d{i}", char_text(1500, i)) for i in range(2)]


@pytest.fixture
def model():
    return tiny_model("llama").eval()


def _results(out) -> dict:
    data = comparable(json.loads((out / "results.json").read_text()))
    data.pop("versions", None)
    return data


def _scored(data: dict) -> list[dict]:
    return [c for c in data["cells"] if c.get("complete")]


# ----------------------------------------------------------------------------------------------- the search space


def _setting(model, families=("longrope",)):
    setting, left_out = space.setting_for(model, 64, TARGET, list(families))
    assert not left_out
    return setting


def test_longrope_starting_points_reproduce_their_schemes(model):
    """The per-pair factors read off the model for PI, NTK, YaRN and llama3, as a longrope spec, give the scheme's
    own logits past the window (YaRN with its attention factor): they are each scheme's effective λ_i."""
    setting = _setting(model)
    ids = torch.randint(3, 100, (1, 200), generator=torch.Generator().manual_seed(0))
    assert setting.seeds["linear"][0] == pytest.approx([4.0] * setting.pairs)
    for scheme, (factors, attention) in setting.seeds.items():
        assert space.monotone(factors), scheme
        hfpatch.patch(model, position=scheme, factor=4.0)
        with torch.no_grad():
            want = model(ids).logits
        hfpatch.unpatch(model)
        params = {"from": scheme, "factors": factors, "attention_factor": attention, "temperature": None}
        hfpatch.patch(model, **space.spec("longrope", params, setting))
        with torch.no_grad():
            got = model(ids).logits
        hfpatch.unpatch(model)
        assert torch.allclose(got, want, atol=1e-5), scheme


@pytest.mark.parametrize("family", list(space.FAMILIES))
def test_mutation_and_crossover_keep_every_constraint(model, family):
    """Thousands of draws from the operators, chained (children of children): none breaks its family's
    constraints (for longrope: every factor >= 1, non-decreasing from high to low frequency, within the ceiling)."""
    setting = _setting(model, [family])
    fam = space.FAMILIES[family]
    rng = random.Random(0)
    pool = fam.start(setting)
    for _ in range(1500):
        if len(pool) > 1 and rng.random() < 0.4:
            child = fam.cross(rng, rng.choice(pool), rng.choice(pool), setting)
        else:
            child = fam.mutate(rng, rng.choice(pool), setting)
        assert fam.why_not(child, setting) is None, child
        pool = [*pool, child][-12:]
    assert len({json.dumps(p, sort_keys=True) for p in pool}) > 1  # the operators do move


def test_monotone_constraint():
    assert space.monotone([1.0, 1.0, 2.0, 4.0])
    assert not space.monotone([1.0, 2.0, 1.5])
    assert not space.monotone([0.9, 1.0])


# -------------------------------------------------------------------------------------------------- the objective


def test_needle_tokens_are_the_answer_and_the_copy_from_beyond_the_window(tok, docs):
    samples = objective.build(tok, objective.calibration_ids(tok, docs), TARGET, 64, 2, 16, seed=3)
    for s in samples:
        assert len(s.ids) == TARGET
        (c0, c1), (a0, a1) = s.needle
        assert a1 == TARGET and a1 - a0 == 6  # " " and the 5-digit key, one character per token
        key = tok.decode(s.ids[a0:a1]).strip()
        assert key.isdigit() and len(key) == 5
        needle = tok.encode(objective.NEEDLE.format(key=key), add_special_tokens=False)
        text = s.ids[:c0 - 1]
        at = next(i for i in range(len(text)) if text[i:i + len(needle)] == needle)
        assert a0 - (at + len(needle)) > 64  # the key is planted more than a window before it is asked for
        copy = s.ids[c0 - 1:c1]
        src = next(i for i in range(c0 - 1 - len(copy)) if s.ids[i:i + len(copy)] == copy)
        assert c0 - 1 - (src + len(copy)) >= 64
    assert samples[0].ids != samples[1].ids


def test_too_short_a_target_names_the_shortest(tok, docs):
    with pytest.raises(ValueError, match=r"use at least \d+"):
        objective.build(tok, objective.calibration_ids(tok, docs), 100, 64, 1, 16, seed=0)


def test_summary_score_and_guard():
    records = [{"needle_nll": 6.0, "needle_tokens": 3, "plain_nll": 10.0, "plain_tokens": 10, "short_nll": 5.0,
                "short_tokens": 5}]
    got = objective.summarize(records, 0.5)
    assert got["score"] == pytest.approx(0.5 * 2.0 + 0.5 * 1.0)
    assert got["needle_ppl"] == pytest.approx(math.exp(2.0))
    assert objective.feasible(got, math.e / 1.01, 0.01)
    assert not objective.feasible(got, math.e / 1.02, 0.01)


# ----------------------------------------------------------------------------------------------------- the loop


def test_same_seed_same_search_other_seed_other_candidates(model, tok, docs, tmp_path):
    a = run_search(model, tok, TARGET, out=tmp_path / "a", budget="14", documents=docs, seed=1, **SMALL)
    b = run_search(model, tok, TARGET, out=tmp_path / "b", budget="14", documents=docs, seed=1, **SMALL)
    run_search(model, tok, TARGET, out=tmp_path / "c", budget="14", documents=docs, seed=2, **SMALL)
    assert _results(tmp_path / "a") == _results(tmp_path / "b")
    assert a == {**b, "results": a["results"]}
    drawn = [[x["spec"] for x in _scored(_results(tmp_path / d)) if x["generation"] > 0] for d in "ac"]
    assert drawn[0] != drawn[1]
    assert json.loads((tmp_path / "a" / "best.json").read_text()) == a["spec"]


def test_budget_of_candidates_is_respected_and_a_resume_continues(model, tok, docs, tmp_path):
    run_search(model, tok, TARGET, out=tmp_path, budget="9", documents=docs, **SMALL)
    assert len(_scored(_results(tmp_path))) == 9
    run_search(model, tok, TARGET, out=tmp_path, budget="13", documents=docs, **SMALL)
    data = _results(tmp_path)
    assert len(_scored(data)) == 13
    assert [c["order"] for c in data["cells"]] == list(range(13))  # continued, nothing scored twice


def test_wall_time_budget_is_respected(model, tok, docs, tmp_path):
    t0 = time.perf_counter()
    run_search(model, tok, TARGET, out=tmp_path, budget="6s", documents=docs, **SMALL)
    took = time.perf_counter() - t0
    data = json.loads((tmp_path / "results.json").read_text())
    run = data["runs"][-1]
    assert "wall-time budget" in run["stopped"]
    slowest = max(c["seconds"] for c in data["cells"] if c.get("complete"))
    assert run["seconds"] <= 6.0 + slowest  # only a candidate slower than expected may pass the budget
    assert took < 6.0 + slowest + 60  # setup (reading the seeds off the model, one timed forward) included


def test_bad_settings_are_refused_before_any_work(model, tok, docs, tmp_path):
    with pytest.raises(ValueError, match="longer than the trained window"):
        run_search(model, tok, 64, out=tmp_path, budget="3", documents=docs, **SMALL)
    with pytest.raises(ValueError, match="needs a budget"):
        Budget()
    with pytest.raises(ValueError, match="neither a wall time"):
        parse_budget("3 days")
    assert parse_budget("2h,50").evaluations == 50 and parse_budget("2h,50").seconds == 7200
    with pytest.raises(ValueError, match="unknown nope"):
        run_search(model, tok, TARGET, out=tmp_path, budget="3", documents=docs, families="nope", **SMALL)
    assert not (tmp_path / "results.json").exists()


def test_another_identity_is_refused(model, tok, docs, tmp_path):
    run_search(model, tok, TARGET, out=tmp_path, budget="2", documents=docs, **SMALL)
    with pytest.raises(ValueError, match="other settings"):
        run_search(model, tok, TARGET, out=tmp_path, budget="2", documents=docs, seed=5, **SMALL)


def test_every_scored_candidate_keeps_its_constraints(model, tok, docs, tmp_path):
    run_search(model, tok, TARGET, out=tmp_path, budget="16", documents=docs, **SMALL)
    setting = _setting(model, list(space.FAMILIES))
    cells = _scored(_results(tmp_path))
    assert {c["family"] for c in cells} >= set(space.FAMILIES)
    for c in cells:
        if c["family"] != "none":
            assert space.why_not(c["family"], c["params"], setting) is None, c["patch"]
            assert c["spec"] == space.spec(c["family"], c["params"], setting)
            hfpatch.spec.request(**c["spec"])  # an ordinary, valid patch spec


# --------------------------------------------------------------------------------------------------- kill, resume


def test_a_killed_search_resumes_to_the_uninterrupted_result(tmp_path):
    folder = save_sized(tmp_path / "model")
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(2):
        (texts / f"d{i}.txt").write_text(char_text(1500, i), encoding="utf-8")
    command = ["search", "--model", str(folder), "--target-length", str(TARGET), "--text-files", str(texts),
               "--budget", "12", "--population", "4", "--parents", "2", "--samples", "2", "--no-plot",
               "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HFPATCH_CACHE": str(tmp_path / "cache")}
    assert subprocess.run([sys.executable, "-m", "hfpatch", *command, "--out", str(tmp_path / "whole")], env=env,
                          capture_output=True).returncode == 0
    out = tmp_path / "killed"
    for kill_after in (3, 8):  # killed mid-generation 0, then mid-generation 1 (between or inside candidates)
        proc = subprocess.Popen([sys.executable, "-m", "hfpatch", *command, "--out", str(out)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            try:
                cells = json.loads((out / "results.json").read_text())["cells"]
            except (OSError, ValueError):
                cells = []
            if sum(len(c["samples"]) for c in cells) >= 2 * kill_after - 1:  # one sample into candidate kill_after
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        assert not (out / "best.json").exists()
    assert subprocess.run([sys.executable, "-m", "hfpatch", *command, "--out", str(out)], env=env,
                          capture_output=True).returncode == 0
    assert _results(out) == _results(tmp_path / "whole")
    assert (out / "best.json").read_text() == (tmp_path / "whole" / "best.json").read_text()
    assert (out / "table.md").read_text() == (tmp_path / "whole" / "table.md").read_text()


# ----------------------------------------------------------------------------------------- the spec it finds


def _best_longrope(model, tok, docs, out) -> dict:
    run_search(model, tok, TARGET, out=out, budget="10", documents=docs, families="longrope", **SMALL)
    cells = [c for c in _scored(_results(out)) if c["family"] == "longrope" and not c["params"]["temperature"]]
    best = min(cells, key=lambda c: c["score"])
    return best["spec"]


def test_found_longrope_spec_saves_and_reloads_in_plain_transformers(model, tok, docs, tmp_path):
    spec = _best_longrope(model, tok, docs, tmp_path / "search")
    ids = torch.randint(3, 100, (1, 200), generator=torch.Generator().manual_seed(1))
    hfpatch.patch(model, **spec)
    with torch.no_grad():
        want = model(ids).logits
    hfpatch.save_pretrained(model, tmp_path / "saved")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    with torch.no_grad():
        assert torch.allclose(plain(ids).logits, want, atol=1e-5)
    assert plain.config.rope_parameters["long_factor"] == spec["long_factor"]
    again = hfpatch.from_pretrained(tmp_path / "saved")
    assert hfpatch.describe(again)["applied"] == hfpatch.spec.request(**spec)


def test_found_longrope_spec_exports_to_gguf(model, tok, docs, tmp_path):
    """A tiny llama GGUF written from the same model: the found spec exported as llama.cpp metadata
    (rope_factors_long) loads back as the model patched in memory."""
    pytest.importorskip("gguf")
    from tiny_gguf import write_llama_gguf

    from hfpatch.interop.gguf import export
    from hfpatch.models import load

    spec = _best_longrope(model, tok, docs, tmp_path / "search")
    src = write_llama_gguf(model, tmp_path / "tiny.gguf")
    written = export(src, tmp_path / "out.gguf", **spec)
    assert "rope_factors_long.weight" in written["tensors"]
    exported, _ = load(str(tmp_path / "out.gguf"), tokenizer=False)
    hfpatch.patch(model, **spec)
    ids = torch.randint(3, 100, (1, 200), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(exported.eval()(ids).logits, model(ids).logits, atol=1e-4)


def test_patch_spec_file_applies_best_json_and_refuses_bad_files(tmp_path, capsys):
    folder = save_sized(tmp_path / "model")
    spec = {"position": "longrope", "factor": 4.0, "original_max_position_embeddings": 64,
            "short_factor": [1.0] * 8, "long_factor": [1.0, 1.5, 2, 2, 3, 4, 4, 5], "attention_factor": 1.0}
    (tmp_path / "best.json").write_text(json.dumps(spec))
    assert cli_main(["patch", str(folder), "--spec-file", str(tmp_path / "best.json"), "--out",
                     str(tmp_path / "out")]) == 0
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["rope_parameters"]["long_factor"] == spec["long_factor"]
    capsys.readouterr()
    assert cli_main(["patch", str(folder), "--spec-file", str(tmp_path / "best.json"), "--factor", "2", "--out",
                     str(tmp_path / "o2")]) == 2
    assert "both give factor" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("[1, 2")
    assert cli_main(["patch", str(folder), "--spec-file", str(tmp_path / "bad.json"), "--out",
                     str(tmp_path / "o3")]) == 2
    err = capsys.readouterr().err
    assert "not valid JSON" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "list.json").write_text("[1]")
    assert cli_main(["patch", str(folder), "--spec-file", str(tmp_path / "list.json"), "--out",
                     str(tmp_path / "o4")]) == 2
    assert "expected a non-empty JSON object" in capsys.readouterr().err
    assert not any((tmp_path / d).exists() for d in ("o2", "o3", "o4"))


def _transformers_warnings(fn) -> list[str]:
    """What transformers logs at WARNING or above while fn() runs."""
    import logging

    from transformers.utils import logging as hf_logging

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler, logger = Keep(level=logging.WARNING), hf_logging.get_logger("transformers")
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    logger.addHandler(handler)
    try:
        fn()
    finally:
        logger.removeHandler(handler)
        hf_logging.set_verbosity(level)
    return seen


def test_the_search_space_makes_transformers_warn_about_nothing(model):
    """Reading the starting points applies linear, ntk, yarn and llama3 to the model: transformers' check of llama3's
    parameters must not see the unpatched window as max_position_embeddings (it warned 'original_max_position_
    embeddings field must be less than max_position_embeddings, got 64 and 64')."""
    seen = _transformers_warnings(lambda: space.setting_for(model, 64, TARGET, list(space.FAMILIES)))
    assert not [m for m in seen if "max_position_embeddings" in m], seen
