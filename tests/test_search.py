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
from hfpatch.lm.text import Document
from hfpatch.search import objective, space
from hfpatch.search import search as run_search
from hfpatch.search.options import Budget, parse_budget
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
    assert a["best"] is None or f"**best** {a['best']} |" in (tmp_path / "a" / "table.md").read_text()


def test_budget_of_candidates_is_respected_and_a_resume_continues(model, tok, docs, tmp_path):
    run_search(model, tok, TARGET, out=tmp_path, budget="9", documents=docs, **SMALL)
    assert len(_scored(_results(tmp_path))) == 9
    run_search(model, tok, TARGET, out=tmp_path, budget="13", documents=docs, **SMALL)
    data = _results(tmp_path)
    assert len(_scored(data)) == 13
    assert [c["order"] for c in data["cells"]] == list(range(13))  # continued, nothing scored twice


def test_estimate_after_generation_0_is_each_familys_starting_point_as_measured(model, tok, docs, tmp_path, capsys):
    n0 = 1 + 4 + 1 + 1 + 1  # the reference and the starting points of longrope (4), yarn, self-extend, dual-chunk
    run_search(model, tok, TARGET, out=tmp_path, budget=str(n0 + 2), documents=docs, **SMALL)
    data = json.loads((tmp_path / "results.json").read_text())
    estimate = data["runs"][-1]["estimate"]
    start = [c for c in data["cells"] if c["generation"] == 0 and c["family"] != "none"
             and any(r.get("guard") for r in c["samples"])]
    by_family: dict[str, list[float]] = {}
    for c in start:
        by_family.setdefault(c["family"], []).append(c["seconds"])
    expected = {f: sum(v) / len(v) for f, v in by_family.items()}
    assert estimate["rank_by_family"] == pytest.approx(expected)
    assert estimate["rank"] == pytest.approx(sum(expected.values()) / len(expected))
    assert "rank_first" in estimate  # the first forwards' estimate, kept beside it
    err = capsys.readouterr().err
    assert "the starting points measured about" in err and "from the first forwards" in err


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
    (tmp_path / "none.json").write_text("{}\n")  # what the search writes when no patch beats the model
    assert cli_main(["patch", str(folder), "--spec-file", str(tmp_path / "none.json"), "--out",
                     str(tmp_path / "o5")]) == 2
    assert "holds no patch" in capsys.readouterr().err
    assert not any((tmp_path / d).exists() for d in ("o2", "o3", "o4", "o5"))


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


# ------------------------------------------------------------------------------------------------- proxy samples

PROXY_TARGET, PROXY_TOKENS = 2048, 512


@pytest.fixture(scope="module")
def long_docs():
    return [Document(f"long{i}", char_text(5000, i)) for i in range(2)]


def _proxies(tok, docs, samples=2, segments=6):
    text = objective.calibration_ids(tok, docs)
    full = objective.build(tok, text, PROXY_TARGET, 64, samples, 16, seed=3)
    return full, objective.build_proxy(tok, full, PROXY_TOKENS, segments, 16)


def test_a_proxy_sample_is_its_full_sample_with_tokens_left_out(tok, long_docs):
    """Every token of a proxy sample is its full sample's token at the same position; it keeps the start, the
    passkey line, the span's source and the end, so every planted distance is the full sample's own; its needle
    tokens are the full sample's; the first token after each jump is not scored."""
    full, proxies = _proxies(tok, long_docs)
    for f, s in zip(full, proxies):
        assert len(s.ids) == len(s.positions) <= PROXY_TOKENS
        assert all(s.ids[i] == f.ids[p] for i, p in enumerate(s.positions))
        assert s.positions[0] == 0 and s.positions[-1] == PROXY_TARGET - 1
        assert all(a < b for a, b in zip(s.positions, s.positions[1:]))
        jumps = tuple(i for i in range(1, len(s.positions)) if s.positions[i] != s.positions[i - 1] + 1)
        assert jumps == s.unscored and 3 <= len(jumps) <= 5
        kept = set(s.positions)
        for a, b in f.planted:
            assert set(range(a, b)) <= kept
        assert [[s.positions[i] for i in range(a, b)] for a, b in s.needle] == [list(range(a, b)) for a, b in f.needle]
    assert proxies[0].ids != proxies[1].ids


def test_a_proxy_that_would_not_be_cheaper_or_cannot_hold_the_needles_is_named(tok):
    assert "not cheaper" in objective.proxy_misfit(tok, 1024, 600, 4, 16)
    assert "cannot hold" in objective.proxy_misfit(tok, 2048, 128, 4, 16)
    assert "cannot keep" in objective.proxy_misfit(tok, 2048, 512, 3, 16)
    assert objective.proxy_misfit(tok, PROXY_TARGET, PROXY_TOKENS, 4, 16) is None


def test_a_proxy_sample_is_read_as_one_document_across_its_jumps(model, tok, long_docs):
    """The last segment's tokens attend to the first segment's (transformers would read position ids that jump as
    packed documents, and mask attention between them, unless told otherwise): changing the first segment's text
    changes the needle tokens' loss."""
    from hfpatch.lm.causal import causal_lm_parts

    sample = _proxies(tok, long_docs, samples=1)[1][0]
    parts = causal_lm_parts(model)
    first = objective.token_nll(parts, sample.ids, sample.positions)
    changed = list(sample.ids)
    changed[5:50] = [(t % 90) + 3 for t in reversed(changed[5:50])]
    second = objective.token_nll(parts, changed, sample.positions)
    end = sample.unscored[-1]
    assert (first[end:] - second[end:]).abs().max() > 1e-6


@pytest.mark.parametrize("family", list(space.FAMILIES))
def test_every_family_reads_a_proxy_sample_by_its_positions(tok, long_docs, family):
    """Each family's starting point on a proxy sample (position ids that skip): the model's own attention path
    (pieces, sdpa) gives what the eager path, which writes every score out at the given positions, gives."""
    sample = _proxies(tok, long_docs, samples=1)[1][0]
    fast = tiny_model("llama").eval()
    eager = tiny_model("llama", attn_implementation="eager").eval()
    eager.load_state_dict(fast.state_dict())
    setting = _setting(fast, [family])
    spec = space.spec(family, space.FAMILIES[family].start(setting)[0], setting)
    from hfpatch.lm.causal import causal_lm_parts

    got = []
    for m in (fast, eager):
        hfpatch.patch(m, **spec)
        got.append(objective.score_sample(causal_lm_parts(m), sample))
    assert got[0]["needle_tokens"] == 21 and got[0]["plain_tokens"] == len(sample.ids) - 1 - 21 - len(sample.unscored)
    for k in ("needle_nll", "plain_nll"):
        assert got[0][k] == pytest.approx(got[1][k], rel=1e-5), k


# ---------------------------------------------------------------------------------------------------- the guard


@pytest.mark.parametrize("family", list(space.FAMILIES))
def test_the_guard_is_the_same_for_candidates_that_agree_on_the_short_context_settings(model, tok, docs, family):
    """What space.Family.short leaves out (for longrope its factors, for every family the attention temperature)
    does not change a read of the trained window, so the search may read the guard's text once for them."""
    setting = _setting(model, [family])
    fam = space.FAMILIES[family]
    start = fam.start(setting)[0]
    rng = random.Random(1)
    other = dict(start)
    while fam.short_key(other) != fam.short_key(start) or other == start:  # same short settings, others moved
        other = {**fam.mutate(rng, start, setting), **fam.short_key(start)}
    other["temperature"] = "llama4"
    assert fam.why_not(other, setting) is None
    ids = objective.guard_ids(tok, objective.calibration_ids(tok, docs), 64)
    from hfpatch.lm.causal import causal_lm_parts

    got = []
    for params in (start, other):
        hfpatch.patch(model, **space.spec(family, params, setting))
        got.append(objective.score_guard(causal_lm_parts(model), ids))
        hfpatch.unpatch(model)
    assert got[0] == got[1]


def test_candidates_share_guard_reads(model, tok, docs, tmp_path):
    run_search(model, tok, TARGET, out=tmp_path, budget="12", documents=docs, **SMALL)
    cells = _scored(_results(tmp_path))
    reads = [r for c in cells for r in c["samples"] if r.get("guard")]
    shared = [r for c in cells for r in c["samples"] if "from" in r]
    assert len(reads) + len(shared) == len(cells) and shared  # one guard record each, some of them shared
    by_name = {c["patch"]: c for c in cells}
    for c in cells:
        record = next(r for r in c["samples"] if "short_nll" in r)
        if "from" in record:
            source = by_name[record["from"]]
            assert space.FAMILIES[c["family"]].short_key(c["params"]) == \
                space.FAMILIES[source["family"]].short_key(source["params"])
            assert record["short_nll"] == next(r for r in source["samples"] if r.get("guard"))["short_nll"]


# ----------------------------------------------------------------------------------------------- the two stages


def test_two_stages_rank_on_proxies_and_decide_at_full_length(model, tok, long_docs, tmp_path):
    found = run_search(model, tok, PROXY_TARGET, out=tmp_path, budget="10", documents=long_docs,
                       proxy_tokens=PROXY_TOKENS, finalists=2, **SMALL)
    data = _results(tmp_path)
    assert data["identity"]["proxy"] == PROXY_TOKENS
    ranked = [c for c in data["cells"] if not c["patch"].endswith("/full")]
    full = [c for c in data["cells"] if c["patch"].endswith("/full")]
    assert len(_scored({"cells": ranked})) == 10
    assert next(c["patch"] for c in full) == "g0c0/full" and len(full) == 3  # the reference and two finalists
    assert all(len([r for r in c["samples"] if "sample" in r]) == 1 for c in full)
    finalists = [c["patch"].removesuffix("/full") for c in full[1:]]
    base = next(c for c in ranked if c["patch"] == "g0c0")["short_ppl"]
    best_two = sorted((c for c in ranked if c["family"] != "none" and objective.feasible(c, base, 0.01)),
                      key=lambda c: c["score"])[:2]
    assert finalists == [c["patch"] for c in best_two]
    if found["best"] is not None:
        by = {c["patch"]: c for c in full}
        assert by[found["best"] + "/full"]["score"] == min(by[f + "/full"]["score"] for f in finalists)
        assert by[found["best"] + "/full"]["score"] < by["g0c0/full"]["score"]


def test_the_unpatched_model_is_scored_at_full_length_before_any_candidate_is_ranked(model, tok, long_docs, tmp_path,
                                                                                     capsys):
    """The full-length stage is reserved from the unpatched model's own full-length samples, measured first: its
    full-length cell comes before every ranked candidate but the reference, and the estimate keeps its time."""
    run_search(model, tok, PROXY_TARGET, out=tmp_path, budget="6", documents=long_docs, proxy_tokens=PROXY_TOKENS,
               finalists=1, **SMALL)
    data = json.loads((tmp_path / "results.json").read_text())
    order = {c["patch"]: c["order"] for c in data["cells"]}
    ranked = [name for name in order if not name.endswith("/full") and name != "g0c0"]
    assert ranked and order["g0c0/full"] < min(order[name] for name in ranked)
    assert data["runs"][-1]["estimate"]["full_sample_reference"] > 0
    assert "the unpatched model's full-length sample measured" in capsys.readouterr().err


def test_the_full_length_reserve_is_each_finalists_samples_at_its_familys_cost(model, tok, long_docs, tmp_path):
    """While candidates are ranked, the full-length stage is reserved as: for each finalist chosen so far and each
    place still open, its samples times the unpatched model's full-length sample times its family's cost at the
    ranking stage (an open place: the costliest family); a family measured at full length counts as measured."""
    from hfpatch.search.api import prepare
    from hfpatch.search.options import SearchOptions

    run_search(model, tok, PROXY_TARGET, out=tmp_path, budget="12", documents=long_docs, proxy_tokens=PROXY_TOKENS,
               finalists=3, **SMALL)
    opts = SearchOptions.from_python(target_length=PROXY_TARGET, out=str(tmp_path), budget="12",
                                     proxy_tokens=PROXY_TOKENS, finalists=3, **SMALL)
    s = prepare(model, tok, opts, long_docs)
    try:
        finalists = s.finalists()
        assert len(finalists) >= 2
        s.results.data["cells"] = [c for c in s.results.data["cells"] if not c["patch"].endswith("/full")
                                   or c["patch"] == "g0c0/full"]  # the finalists not yet scored at full length
        unpatched = len(s.plan.ranking) * 1.0 + 3.0  # a ranked unpatched candidate: its samples and a guard read
        s.clock.estimate = {"rank_sample": 1.0, "guard": 3.0, "full_sample": 4.0, "full_sample_reference": 10.0}
        costs = {"longrope": 1.5, "yarn": 1.2, "self-extend": 2.5, "dual-chunk": 2.0}  # x the unpatched model
        for cell in s.cells:  # every ranked candidate of a family took its cost
            if cell["family"] != "none" and "seconds" in cell:
                cell["seconds"] = costs[cell["family"]] * unpatched
        reading = {c["family"] for c in s.cells if c["family"] != "none" and any(r.get("guard") for r in c["samples"])}
        samples = len(s.plan.samples)
        costliest = max(costs[f] for f in reading)
        want = (sum(samples * 10.0 * costs[c["family"]] for c in finalists)
                + (3 - len(finalists)) * samples * 10.0 * costliest)
        assert s.full_reserve() == pytest.approx(want)
        family = finalists[0]["family"]
        s.clock.full_by_family[family] = [7.0, 9.0]  # measured at full length here: the slowest of them counts
        mine = sum(1 for c in finalists if c["family"] == family)
        assert s.full_reserve() == pytest.approx(want - mine * samples * (10.0 * costs[family] - 9.0))
    finally:
        s.results.close()


def test_a_familys_cost_is_the_median_of_its_ranked_candidates_that_read_the_guard():
    """One slow candidate (something else ran beside it) does not move its family's cost; candidates that share
    another's guard read, the unpatched model and full-length cells do not count."""
    from hfpatch.search.loop import ranked_seconds_by_family

    def cell(family, seconds, guard=True, patch="g1c0"):
        return {"patch": patch, "family": family, "seconds": seconds,
                "samples": [{"guard": True} if guard else {"from": "g0c1"}, {"sample": 0}]}

    cells = [cell("dual-chunk", 15.0), cell("dual-chunk", 16.0), cell("dual-chunk", 90.0), cell("yarn", 12.0),
             cell("yarn", 3.0, guard=False), cell("none", 10.0), {"patch": "g1c0/full", "family": "yarn",
                                                                   "samples": [{"guard": True}]}]
    assert ranked_seconds_by_family(cells) == {"dual-chunk": 16.0, "yarn": 12.0}


def test_when_no_patch_beats_the_unpatched_model_best_json_is_the_model_as_it_is(model, tok, docs, tmp_path,
                                                                                   monkeypatch, capsys):
    """Every patch scored worse than the unpatched model (a stand-in objective that adds 1 nat to a patched model's
    NLL): the search says so, and best.json is {} (no patch)."""
    real = objective.score_sample

    def worse_when_patched(parts, sample):
        record = real(parts, sample)
        if hfpatch.describe(model)["applied"]:
            record["needle_nll"] += record["needle_tokens"]
            record["plain_nll"] += record["plain_tokens"]
        return record

    monkeypatch.setattr(objective, "score_sample", worse_when_patched)
    found = run_search(model, tok, TARGET, out=tmp_path, budget="9", documents=docs, **SMALL)
    assert found["best"] is None and found["spec"] == {}
    assert json.loads((tmp_path / "best.json").read_text()) == {}
    assert "no patch beats the unpatched model" in capsys.readouterr().err


def test_a_model_in_train_mode_is_searched_in_eval_mode_and_left_in_train_mode(tok, docs, tmp_path):
    """Dropout on would make every score random: the search runs in eval mode, and gives the model its modes
    back."""
    model = tiny_model("llama", attention_dropout=0.5).eval()
    run_search(model, tok, TARGET, out=tmp_path / "eval", budget="6", documents=docs, **SMALL)
    model.train()
    run_search(model, tok, TARGET, out=tmp_path / "train", budget="6", documents=docs,
               identity={"model": "the same weights"}, **SMALL)
    assert model.training and all(m.training for m in model.modules())
    scores = [[c["score"] for c in _scored(_results(tmp_path / d))] for d in ("eval", "train")]
    assert scores[0] == scores[1]


# ------------------------------------------------------------------------------------------------------ budgets


def test_a_budget_given_twice_is_refused():
    with pytest.raises(ValueError, match="number of candidates twice"):
        parse_budget("3,50")
    with pytest.raises(ValueError, match="wall time twice"):
        parse_budget("1h,30m")


def test_a_wall_time_budget_too_small_for_one_candidate_says_what_it_needs(model, tok, docs, tmp_path):
    with pytest.raises(ValueError, match=r"cannot score one candidate here.*give --budget \d+m or more"):
        run_search(model, tok, TARGET, out=tmp_path, budget="0.001s", documents=docs, **{**SMALL, "plot": True})
    assert not (tmp_path / "table.md").exists() and not (tmp_path / "convergence.png").exists()


def test_the_cli_refuses_a_too_small_budget_in_one_line(tmp_path, capsys):
    folder = save_sized(tmp_path / "model")
    (tmp_path / "t.txt").write_text(char_text(1500, 0) + char_text(1500, 1), encoding="utf-8")
    code = cli_main(["search", "--model", str(folder), "--target-length", str(TARGET), "--text-files",
                     str(tmp_path / "t.txt"), "--budget", "0.01s", "--samples", "1", "--out", str(tmp_path / "s"),
                     "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "cannot score one candidate" in err[-1] and err[-1].startswith("hfpatch search: error:")
    assert not (tmp_path / "s" / "table.md").exists()


@pytest.mark.parametrize("ratio", [1.0001, 1.005, 1.5, 100.0, 25000.0, 1e6])
def test_starting_points_and_their_children_keep_the_constraints_at_any_ratio(ratio):
    """The ranges are the setting's: YaRN's factor range holds the ratio itself however close to 1, and the
    attention factor's range holds YaRN's default 0.1 ln s + 1 however far the target."""
    window = 1024
    setting = space.Setting(window, math.ceil(window * ratio))
    rng = random.Random(0)
    for name in ("yarn", "self-extend", "dual-chunk"):
        fam = space.FAMILIES[name]
        for params in fam.start(setting):
            assert fam.why_not(params, setting) is None, (name, params)
            child = params
            for _ in range(50):
                child = fam.mutate(rng, child, setting)
                assert fam.why_not(child, setting) is None, (name, child)


def test_longrope_starting_points_keep_the_constraints_far_past_the_window(model):
    setting, _ = space.setting_for(model, 64, 64 * 25000, ["longrope"])
    fam = space.FAMILIES["longrope"]
    for params in fam.start(setting):
        assert fam.why_not(params, setting) is None, params["from"]


# ----------------------------------------------------------------------------------------- declared options


def test_the_options_are_declared_once_for_the_parser_the_call_and_the_identity():
    import dataclasses

    from hfpatch.search import options

    fields = {f.name: f for f in dataclasses.fields(options.SearchOptions)}
    parser = options.build_parser()
    dests = {a.dest for a in parser._actions if a.dest != "help"}
    assert dests == {n for n, f in fields.items() if f.metadata["declared"].cli}
    args = parser.parse_args(["--target-length", "16k", "--budget", "1h", "--families", "yarn,longrope"])
    opts = options.SearchOptions.from_args(args)
    assert opts.target_length == 16384 and opts.the_budget.seconds == 3600 and opts.families == ["yarn", "longrope"]
    assert opts == options.SearchOptions(target_length=16384, budget="1h", families="yarn,longrope")
    identity = opts.identity()
    assert set(identity) == {n for n, f in fields.items() if f.metadata["declared"].identity}
    with pytest.raises(TypeError, match=r"unknown option.*nope.*accepted: target_length"):
        options.SearchOptions.from_python(target_length=100, budget="3", nope=1)
    with pytest.raises(TypeError, match=r"unknown option.*dtype"):  # the command line's own: a model is given
        options.SearchOptions.from_python(target_length=100, budget="3", dtype="bf16")
    assert tuple(space.FAMILIES) == options.FAMILY_NAMES


@pytest.mark.parametrize("bad", [{"population": 0}, {"seed": -1}, {"needle_weight": 1.5}, {"guard": float("nan")},
                                 {"proxy_tokens": -1}, {"finalists": 2.5}, {"samples": True},
                                 {"families": "yarn,nope"}, {"budget": 3}, {"out": 5}])
def test_bad_options_are_one_clear_error(bad):
    from hfpatch.search.options import SearchOptions

    with pytest.raises((ValueError, TypeError)) as e:
        SearchOptions(**{"target_length": 100, "budget": "3", **bad})
    assert next(iter(bad)) in str(e.value) and "\n" not in str(e.value)
