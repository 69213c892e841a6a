"""eval ppl: chunked scoring equals full logits; the tool's perplexity and bits per byte equal hand computations for
both windowings; resume; data sources; tokenization cache; one-line errors with exit code 2."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import FAMILIES, tiny_model, tokens

import hfpatch
from hfpatch.cli import main as cli_main
from hfpatch.evaluate import sweep
from hfpatch.evaluate.common import applied
from hfpatch.evaluate.evaluations import ppl as perplexity
from hfpatch.evaluate.results import comparable as strip_timing
from hfpatch.evaluate.transformers_engine import TransformersEngine
from hfpatch.lm import text
from hfpatch.lm.causal import causal_lm_parts, window_nll, windows
from hfpatch.tiny import char_text as text_of
from hfpatch.tiny import char_tokenizer as tiny_tokenizer
from hfpatch.tiny import save_sized as save_tiny

CAUSAL = [f for f in FAMILIES if f != "bert"]


# ---------------------------------------------------------------------------------------------------------------
# helpers


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HFPATCH_CACHE", str(tmp_path / "cache"))  # never the user's cache


@pytest.fixture
def tiny_run(tmp_path):
    """A saved tiny llama + char tokenizer, and a folder with two documents."""
    model_dir = save_tiny(tmp_path / "model")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(text_of(130, 1), encoding="utf-8")
    (docs / "b.txt").write_text(text_of(110, 2), encoding="utf-8")
    (docs / "0short.txt").write_text("too short", encoding="utf-8")
    return model_dir, docs


# ---------------------------------------------------------------------------------------------------------------
# scoring


@pytest.mark.parametrize("family", CAUSAL)
def test_chunked_scoring_equals_full_logits(family):
    model = tiny_model(family)
    ids = tokens(60)[0]
    head_rows = []
    parts = causal_lm_parts(model)
    hook = parts.head.register_forward_hook(lambda m, i, o: head_rows.append(i[0].shape[0]))
    try:
        for first in (1, 23):
            nll, n = window_nll(parts, ids, first=first, chunk=7)
            with torch.no_grad():
                logits = model(ids[None]).logits[0].float()  # softcapped where the family caps (gemma2/3)
            expected = F.cross_entropy(logits[first - 1 : -1], ids[first:], reduction="sum").item()
            assert n == 60 - first
            assert abs(nll - expected) <= 1e-5 * abs(expected), (family, first, nll, expected)
    finally:
        hook.remove()
    assert max(head_rows) <= 7  # the LM head never saw more than one chunk of positions


def test_masked_lm_is_refused():
    with pytest.raises(ValueError, match="not a causal language model"):
        causal_lm_parts(tiny_model("bert"))


def test_windows():
    assert windows(100, 32, "chunks") == [(0, 32, 1), (32, 64, 1), (64, 96, 1)]
    # ends every 16 tokens from 32, then the last window ends at 100 and scores only what is new
    assert windows(100, 32, "sliding", 16) == [(0, 32, 1), (16, 48, 16), (32, 64, 16), (48, 80, 16), (64, 96, 16),
                                               (68, 100, 28)]
    for n, length, stride in ((100, 32, 16), (97, 10, 3), (50, 50, 7), (64, 16, 15), (64, 16, 1)):
        scored = [s + t for s, e, f in windows(n, length, "sliding", stride) for t in range(f, e - s)]
        assert sorted(scored) == list(range(1, n))  # every token but the first, exactly once
    for stride in (0, 32, 33):  # a stride of the whole length would leave each window's first token unscored
        with pytest.raises(ValueError, match="stride"):
            windows(100, 32, "sliding", stride)


# ---------------------------------------------------------------------------------------------------------------
# the tool against hand computations


def _hand(model, ids, length, windowing, stride):
    """exp(mean NLL) and the scored positions, computed the textbook way from full logits (HF-guide labels)."""
    total, count, scored = 0.0, 0, []
    if windowing == "chunks":
        for k in range(len(ids) // length):
            chunk = ids[k * length : (k + 1) * length]
            with torch.no_grad():
                logits = model(chunk[None]).logits[0]
            total += F.cross_entropy(logits[:-1], chunk[1:], reduction="sum").item()
            count += length - 1
            scored += range(k * length + 1, (k + 1) * length)
    else:  # windows end at length, length+stride, ..., and at len(ids); each scores the tokens not scored yet
        ends = list(range(length, len(ids) + 1, stride))
        ends += [len(ids)] if ends[-1] != len(ids) else []
        prev = 0
        for end in ends:
            window = ids[end - length : end]
            labels = window.clone()
            new = end - prev if prev else length
            labels[: length - new] = -100
            with torch.no_grad():
                loss = model(window[None], labels=labels[None]).loss.item()
            n = min(new, length - 1)
            total += loss * n
            count += n
            scored += range(end - n, end)
            prev = end
    return total, count, scored


def test_ppl_and_bpb_equal_hand_computation(tiny_run, tmp_path, capsys):
    model_dir, docs = tiny_run
    out = tmp_path / "out"
    argv = ["--model", str(model_dir), "--text-files", str(docs), "--lengths", "16,48", "--tokens-per-doc", "96",
            "--max-docs", "2", "--windowing", "both", "--stride", "12", "--patches", "none,yarn:2",
            "--score-chunk", "5", "--out", str(out)]
    assert cli_main(["eval", "ppl", *argv]) == 0
    printed = capsys.readouterr()
    res = json.loads((out / "results.json").read_text())
    assert res["corpus"]["skipped"] == 1 and [d["name"] for d in res["corpus"]["documents"]] == \
        [str(docs / "a.txt"), str(docs / "b.txt")]  # 0short.txt (9 tokens) skipped; path order
    assert "skipped 1 document" in printed.err

    model = hfpatch.from_pretrained(model_dir).eval()
    tok = tiny_tokenizer()
    texts = [(docs / n).read_text(encoding="utf-8") for n in ("a.txt", "b.txt")]
    assert len(res["cells"]) == 2 * 2 * 2
    for cell in res["cells"]:
        kwargs = hfpatch.spec.parse(cell["patch"])
        if kwargs:
            hfpatch.patch(model, **kwargs)
        try:
            total = count = nbytes = 0
            for text, doc in zip(texts, cell["documents"]):
                ids = torch.tensor(tok(text)["input_ids"][:96])
                assert len(ids) == 96 and len(text) >= 96  # one token per character
                nll, n, scored = _hand(model, ids, cell["length"], cell["windowing"], 12)
                doc_bytes = sum(len(text[t].encode("utf-8")) for t in scored)  # token t is character t
                assert doc["tokens"] == n and doc["bytes"] == doc_bytes
                assert abs(doc["nll_sum"] - nll) <= 1e-5 * nll
                total, count, nbytes = total + nll, count + n, nbytes + doc_bytes
        finally:
            hfpatch.unpatch(model)
        assert cell["tokens"] == count
        assert abs(cell["ppl"] - math.exp(total / count)) <= 1e-5 * cell["ppl"]
        assert abs(cell["bpb"] - total / math.log(2) / nbytes) <= 1e-5 * cell["bpb"]
        assert f"{cell['ppl']:.2f}" in printed.out  # the Markdown table shows it
    assert nbytes > count  # the multi-byte characters were counted as bytes, not as one each
    by = {(c["patch"], c["windowing"], c["length"]): c["ppl"] for c in res["cells"]}
    assert by[("none", "chunks", 16)] != by[("none", "sliding", 16)]
    assert by[("none", "chunks", 16)] != by[("yarn:2", "chunks", 16)]
    assert (out / "table.md").read_text().count("| none |") == 4  # ppl and bpb, for each windowing
    assert (out / "ppl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert res["model"]["trained_window"] == 64 and res["versions"]["transformers"]
    assert res["settings"]["lengths"] == [16, 48] and res["identity"]["tokens_per_doc"] == 96


# ---------------------------------------------------------------------------------------------------------------
# resume


def interrupt_document(monkeypatch, n):
    """A Ctrl-C at the run's `n`-th document (sweep.Run.document_nll); returns the real document_nll."""
    real, calls = sweep.Run.document_nll, []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(sweep.Run, "document_nll", interrupted)
    return real


def test_interrupted_run_resumes_without_recomputing(tiny_run, tmp_path, monkeypatch, capsys):
    model_dir, docs = tiny_run
    common = ["--model", str(model_dir), "--text-files", str(docs), "--lengths", "16,32", "--max-docs", "2",
              "--patches", "none,ntk:2", "--no-plot"]
    assert perplexity.main([*common, "--out", str(tmp_path / "whole")]) == 0
    whole = json.loads((tmp_path / "whole" / "results.json").read_text())

    real = interrupt_document(monkeypatch, 4)  # the 4th document: the second of the second cell
    out = tmp_path / "resumed"
    assert perplexity.main([*common, "--out", str(out)]) == 130
    assert "run the same command again to resume" in capsys.readouterr().err
    partial = json.loads((out / "results.json").read_text())
    assert [c["complete"] for c in partial["cells"]] == [True, False]
    assert len(partial["cells"][1]["documents"]) == 1  # finished documents of an unfinished cell are kept too

    counted = []
    monkeypatch.setattr(sweep.Run, "document_nll", lambda *a, **k: counted.append(1) or real(*a, **k))
    assert perplexity.main([*common, "--out", str(out)]) == 0
    assert len(counted) == 2 * 2 * 2 - 3  # 4 cells x 2 documents, minus the 3 already done
    final = json.loads((out / "results.json").read_text())
    assert final["cells"][0] == partial["cells"][0]  # untouched, timings included
    assert strip_timing(final) == strip_timing(whole)

    counted.clear()  # a finished run is only reported again, without loading the model
    monkeypatch.setattr(TransformersEngine, "load",
                        staticmethod(lambda args: pytest.fail("loaded the model for nothing")))
    assert perplexity.main([*common, "--out", str(out)]) == 0 and not counted

    # other settings are refused, not mixed into the file
    assert perplexity.main([*common[:-3], "--max-docs", "1", "--no-plot", "--out", str(out)]) == 2
    assert "other settings" in capsys.readouterr().err


def test_device_map_auto_and_dtype_run(tiny_run, tmp_path):
    """--device-map auto goes through accelerate (on this CPU machine everything lands on the CPU): same numbers.
    --dtype bf16 runs and lands near fp32."""
    model_dir, docs = tiny_run
    common = ["--model", str(model_dir), "--text-files", str(docs), "--lengths", "32", "--patches", "none",
              "--no-plot"]
    got = {}
    for name, extra in (("plain", []), ("auto", ["--device-map", "auto"]), ("bf16", ["--dtype", "bf16"])):
        assert perplexity.main([*common, *extra, "--out", str(tmp_path / name)]) == 0
        got[name] = json.loads((tmp_path / name / "results.json").read_text())["cells"][0]["ppl"]
    assert got["auto"] == pytest.approx(got["plain"], rel=1e-6)
    assert got["bf16"] != got["plain"] and got["bf16"] == pytest.approx(got["plain"], rel=0.05)


# ---------------------------------------------------------------------------------------------------------------
# data


def test_dataset_equals_the_same_text_files(tiny_run, tmp_path):
    model_dir, docs = tiny_run
    ds = tmp_path / "ds"
    ds.mkdir()
    rows = [{"body": (docs / n).read_text(encoding="utf-8"), "id": i} for i, n in enumerate(("0short.txt", "a.txt"))]
    (ds / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["--model", str(model_dir), "--lengths", "32", "--patches", "none", "--no-plot"]
    assert perplexity.main([*common, "--dataset", str(ds), "--split", "train", "--text-field", "body",
                            "--out", str(tmp_path / "d")]) == 0
    assert perplexity.main([*common, "--text-files", str(docs / "a.txt"), "--out", str(tmp_path / "f")]) == 0
    d = json.loads((tmp_path / "d" / "results.json").read_text())
    f = json.loads((tmp_path / "f" / "results.json").read_text())
    assert d["corpus"]["skipped"] == 1 and d["corpus"]["documents"][0]["name"].endswith("train[1]")
    assert d["cells"][0]["nll_sum"] == f["cells"][0]["nll_sum"] and d["cells"][0]["bytes"] == f["cells"][0]["bytes"]


def test_default_corpus_is_long_stdlib_sources():
    docs = text.default_corpus()
    assert docs and all(d.name.startswith("stdlib/") for d in docs)
    assert sum(len(d.text) > 200_000 for d in docs) >= 1  # _pydecimal.py: far more than 16k tokens


def test_tokenization_cache(tmp_path, monkeypatch):
    tok = tiny_tokenizer()
    doc = text.Document("x", text_of(300, 3))
    first = text.tokenize(tok, doc)
    assert list((tmp_path / "cache" / "tokens").rglob("*.npz"))
    def again(*a):
        raise RuntimeError("tokenized again despite the cache")

    monkeypatch.setattr(text, "_tokenize", again)
    again = text.tokenize(tok, doc)
    assert (again.ids == first.ids).all() and (again.ends == first.ends).all()
    assert first.ends[-1] == len(doc.text.encode("utf-8"))
    with pytest.raises(RuntimeError, match="tokenized again"):  # other text: another key
        text.tokenize(tok, text.Document("x", doc.text + "!"))


# ---------------------------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("argv,message", [
    (["--text-files", "MISSING"], "no such file or folder"),
    (["--text-files", "DOCS", "--lengths", "16,4k"], "no document has 4096 tokens"),
    (["--text-files", "DOCS", "--patches", "none,yarm:2"], "unknown position scheme 'yarm'"),
    (["--text-files", "DOCS", "--patches", "none,yarn:1"], "factor must be > 1"),
    (["--text-files", "DOCS", "--patches", "yarn:2,yarn:2.0"], "are the same patch"),
    (["--text-files", "DOCS", "--lengths", "2x"], "not a number of tokens"),
    (["--text-files", "DOCS", "--stride", "8"], "--stride applies to --windowing sliding"),
    (["--dataset", "DOCS", "--split", "train", "--text-field", "nope"], "has no field 'nope'"),
    (["--dataset", "MISSING"], "could not load dataset"),
    (["--text-files", "DOCS", "--lengths", "16", "--model", "BERT"], "not a causal language model"),
    (["--text-files", "DOCS", "--lengths", "16", "--frobnicate"], "unrecognized arguments"),
])
def test_bad_input_is_one_line_and_exit_2(tiny_run, tmp_path, capsys, argv, message):
    model_dir, docs = tiny_run
    if "BERT" in argv:
        save_tiny(tmp_path / "bert", "bert")
    capsys.readouterr()  # what saving printed
    subs = {"MISSING": str(tmp_path / "missing.txt"), "DOCS": str(docs), "BERT": str(tmp_path / "bert")}
    argv = ["--model", str(model_dir), "--out", str(tmp_path / "o"), *[subs.get(a, a) for a in argv]]
    assert cli_main(["eval", "ppl", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err, err


def test_learned_position_table_limits_the_length(tiny_run, tmp_path, capsys):
    """gpt2 has 64 learned positions here: 32 runs; 128 is refused after loading, before any scoring."""
    _, docs = tiny_run
    model_dir = save_tiny(tmp_path / "gpt2", "gpt2")
    common = ["--model", str(model_dir), "--text-files", str(docs), "--patches", "none", "--no-plot"]
    assert perplexity.main([*common, "--lengths", "32", "--out", str(tmp_path / "ok")]) == 0
    assert perplexity.main([*common, "--lengths", "128", "--out", str(tmp_path / "long")]) == 2
    assert "learned positions for 64 tokens only" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "long" / "results.json").exists() or not json.loads(
        (tmp_path / "long" / "results.json").read_text())["cells"]
    # position schemes that no longer read the table are not held to its size; interpolation moves it
    assert perplexity.main([*common[:-3], "--patches", "alibi,nope,sinusoidal", "--no-plot", "--lengths", "128",
                            "--out", str(tmp_path / "alibi")]) == 0
    assert perplexity.main([*common[:-3], "--patches", "interpolate:2", "--no-plot", "--lengths", "128",
                            "--out", str(tmp_path / "interp")]) == 0
    assert perplexity.main([*common[:-3], "--patches", "interpolate:1.5", "--no-plot", "--lengths", "128",
                            "--out", str(tmp_path / "interp_short")]) == 2
    assert "learned positions for 96 tokens only" in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_command_in_a_process_of_its_own(tmp_path):
    r = subprocess.run([sys.executable, "-m", "hfpatch", "eval", "ppl", "--patches", "none,yarm:2"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "unknown position scheme" in r.stderr


def test_tokenizer_fingerprint_is_not_reused_by_a_new_tokenizer():
    """The cache key of a tokenizer must be its own: keyed by id(), a new tokenizer that Python placed where a
    freed one lived got the freed one's fingerprint (and would read its cached token ids)."""
    import gc
    import hashlib

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    wrong = []
    for i in range(10):
        tok = PreTrainedTokenizerFast(unk_token="<unk>", tokenizer_object=Tokenizer(
            models.WordLevel(vocab={"<unk>": 0, "a": 1, f"w{i}": 2}, unk_token="<unk>")))
        truth = hashlib.sha256(tok.backend_tokenizer.to_str().encode("utf-8")).hexdigest()
        wrong += [i] if text.tokenizer_fingerprint(tok) != truth else []
        del tok
        gc.collect()  # the next tokenizer may now be allocated at the same address
    assert not wrong
    tok = tiny_tokenizer()
    before = text.tokenizer_fingerprint(tok)
    tok.add_tokens(["<new>"])  # a grown vocabulary tokenizes differently: a new fingerprint
    assert text.tokenizer_fingerprint(tok) != before


def test_given_text_is_scored_whole_by_default(tiny_run, tmp_path, capsys):
    """Files named by the user: every long-enough document, all of it (chunks: cut to a multiple of the longest
    length; sliding and rolling: every token). The default corpus stays one document of the longest length."""
    model_dir, docs = tiny_run
    (docs / "c.txt").write_text(text_of(75, 3), encoding="utf-8")
    assert cli_main(["eval", "ppl", "--model", str(model_dir), "--text-files", str(docs), "--lengths", "16,32",
                     "--windowing", "chunks,sliding", "--patches", "none", "--no-plot",
                     "--out", str(tmp_path / "o")]) == 0
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    assert [d["name"].rsplit("/", 1)[1] for d in res["corpus"]["documents"]] == ["a.txt", "b.txt", "c.txt"]
    assert res["identity"]["tokens_per_doc"] == "all" and res["corpus"]["skipped"] == 1
    by = {(c["windowing"], c["length"]): c for c in res["cells"]}
    lengths = {"a.txt": 130, "b.txt": 110, "c.txt": 75}  # one token per character
    for (w, n), c in by.items():
        expected = 0
        for d in c["documents"]:
            total = lengths[d["name"].rsplit("/", 1)[1]]
            span = total // 32 * 32 if w == "chunks" else total  # chunks: a multiple of the longest length
            expected += span // n * (n - 1) if w == "chunks" else span - 1
        assert c["tokens"] == expected, (w, n)
    assert by[("chunks", 16)]["tokens"] == (128 + 96 + 64) - (8 + 6 + 4)  # each window's first token unscored

    err = capsys.readouterr().err
    assert "tokens to read: about" in err and "estimated from a timed" in err  # the estimate, before scoring
    assert cli_main(["eval", "ppl", "--model", str(model_dir), "--lengths", "16", "--patches", "none", "--no-plot",
                     "--out", str(tmp_path / "d")]) == 0
    res = json.loads((tmp_path / "d" / "results.json").read_text())
    assert len(res["corpus"]["documents"]) == 1 and res["identity"]["tokens_per_doc"] == 16


def test_dry_run_estimates_and_scores_nothing(tiny_run, tmp_path, monkeypatch, capsys):
    model_dir, docs = tiny_run
    monkeypatch.setattr(sweep.Run, "document_nll", lambda *a, **k: pytest.fail("a dry run scored"))
    assert perplexity.main(["--model", str(model_dir), "--text-files", str(docs), "--lengths", "16",
                            "--patches", "none,yarn:2", "--dry-run", "--out", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert "2 cell(s) of 2 documents each and" in err and "about" in err
    assert not (tmp_path / "o").exists()  # nothing written: no results file, no lock, not even the folder


def test_a_dry_run_does_not_decide_the_real_runs_settings(tiny_run, tmp_path, capsys):
    """A dry run writes nothing, so the real run that follows with other settings is not refused; a dry run on an
    existing results file reads it (what is left, refusals of other settings) and leaves it as it was."""
    model_dir, docs = tiny_run
    out = tmp_path / "o"
    common = ["--model", str(model_dir), "--text-files", str(docs), "--patches", "none", "--no-plot", "--out",
              str(out)]
    assert perplexity.main([*common, "--lengths", "32", "--max-docs", "1", "--dry-run"]) == 0
    assert perplexity.main([*common, "--lengths", "32"]) == 0  # other documents: refused once a dry run wrote
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert perplexity.main([*common, "--lengths", "32", "--dry-run"]) == 0
    assert "nothing left to run" in capsys.readouterr().err
    assert perplexity.main([*common, "--lengths", "32", "--max-docs", "1", "--dry-run"]) == 2
    assert "other settings" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_estimate_counts_one_document_once_however_many_cells_read_it(tiny_run, tmp_path, capsys):
    """The main job reads one document in 6 cells: the estimate line said "6 cell(s), 6 documents"."""
    model_dir, docs = tiny_run
    one = tmp_path / "one"
    one.mkdir()
    (one / "a.txt").write_text((docs / "a.txt").read_text(encoding="utf-8"), encoding="utf-8")
    assert perplexity.main(["--model", str(model_dir), "--text-files", str(one), "--lengths", "16,32",
                            "--patches", "none,yarn:2", "--dry-run", "--out", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert "4 cell(s) of 1 document each and" in err


def test_memory_that_cannot_fit_is_refused_before_loading(tiny_run, tmp_path, monkeypatch, capsys):
    """An estimate from the config alone (weights + activations + the scoring chunk), against the free memory."""
    from hfpatch.lm import budget

    model_dir, docs = tiny_run
    shape = budget.shape_of(str(model_dir))
    model = hfpatch.from_pretrained(model_dir)
    assert shape.params == sum(p.numel() for p in model.parameters())  # the weights, counted on the meta device
    need = budget.memory_needed(shape, 4, 100_000, score_chunk=1024)
    assert need["weights"] == shape.params * 4 and need["scoring"] == 1024 * 101 * 8
    assert need["activations"] == 100_000 * (2 * 64 + max(2 * 4 * 16 + 2 * 2 * 16 + 64, 3 * 128)) * 4
    assert budget.memory_needed(shape, 4, 200_000)["total"] > budget.memory_needed(shape, 4, 100_000)["total"]

    monkeypatch.setattr(budget, "available_memory", lambda device, device_map: (50 * 2**20, "CPU"))
    monkeypatch.setattr(TransformersEngine, "load",
                        staticmethod(lambda args: pytest.fail("loaded the model before refusing")))
    argv = ["--model", str(model_dir), "--text-files", str(docs), "--lengths", "16", "--tokens-per-doc", "96",
            "--patches", "none", "--no-plot", "--out", str(tmp_path / "o")]
    long = ["--model", str(model_dir), "--text-files", str(tmp_path / "long.txt"), "--lengths", "64k",
            "--patches", "none", "--no-plot", "--out", str(tmp_path / "o")]
    (tmp_path / "long.txt").write_text("x" * 70_000)
    capsys.readouterr()
    assert perplexity.main(long) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "reading 65536 tokens needs about" in err and "50 MiB is free on the CPU" in err
    assert "--no-memory-check" in err and "up to about" in err
    monkeypatch.undo()
    monkeypatch.setenv("HFPATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(budget, "available_memory", lambda device, device_map: (50 * 2**20, "CPU"))
    assert perplexity.main(argv) == 0  # a short run fits in the same 50 MiB
    assert perplexity.main([*long[:-1], str(tmp_path / "o2"), "--no-memory-check", "--dry-run"]) == 0


# ---------------------------------------------------------------------------------------------------------------
# a model loaded patched


def _saved_with_yarn(model_dir, path):
    """The tiny model saved patched with yarn:4 by hfpatch (with its tokenizer)."""
    model = hfpatch.patch(hfpatch.from_pretrained(model_dir), position="yarn", factor=4)
    hfpatch.save_pretrained(model, path, tokenizer=tiny_tokenizer())
    return path


def test_none_is_the_model_as_loaded_and_specs_replace_its_patch(tiny_run, tmp_path):
    """A folder saved with yarn:4: `none` measures it as loaded whatever other specs run beside it (ntk:2 used to
    unpatch the loaded yarn, so the none row measured the base model); ntk:2 replaces yarn on the base RoPE."""
    model_dir, docs = tiny_run
    saved = _saved_with_yarn(model_dir, tmp_path / "yarn4")
    common = ["--text-files", str(docs), "--lengths", "16,48", "--tokens-per-doc", "96", "--max-docs", "2",
              "--no-plot"]

    def ppl(model, patches, out):
        assert perplexity.main(["--model", str(model), *common, "--patches", patches, "--out", str(out)]) == 0
        res = json.loads((out / "results.json").read_text())
        return res, {(c["patch"], c["length"]): c["ppl"] for c in res["cells"]}

    both, got = ppl(saved, "ntk:2,none", tmp_path / "both")  # ntk:2 first: `none` runs after it was removed
    _, alone = ppl(saved, "none", tmp_path / "alone")
    plain, base = ppl(model_dir, "none,ntk:2", tmp_path / "base")
    for n in (16, 48):
        assert got[("none", n)] == alone[("none", n)]
        assert got[("ntk:2", n)] == base[("ntk:2", n)]  # over the checkpoint's base RoPE, not stacked on yarn
    assert got[("none", 48)] != base[("none", 48)]  # the saved model is not the base one

    # the none row is the saved model's own loss, computed by hand
    model = hfpatch.from_pretrained(saved).eval()
    texts = [(docs / n).read_text(encoding="utf-8") for n in ("a.txt", "b.txt")]
    total = count = 0
    for t in texts:
        nll, n, _ = _hand(model, torch.tensor(tiny_tokenizer()(t)["input_ids"][:96]), 48, "chunks", 0)
        total, count = total + nll, count + n
    assert got[("none", 48)] == pytest.approx(math.exp(total / count), rel=1e-5)

    assert both["model"]["loaded_with"] == "yarn:4" and plain["model"]["loaded_with"] is None
    assert "loaded with yarn:4" in (tmp_path / "both" / "table.md").read_text().splitlines()[0]


def test_a_spec_leaves_the_loaded_model_exactly_as_loaded(tiny_run, tmp_path):
    model_dir, _ = tiny_run
    model = hfpatch.from_pretrained(_saved_with_yarn(model_dir, tmp_path / "yarn4")).eval()
    ids = torch.arange(3, 60)[None]
    with torch.no_grad():
        before = model(ids).logits
    for kwargs in ({"position": "ntk", "factor": 2}, {"position": "alibi"}, {"norm": "layernorm"}):
        with applied(model, kwargs, "spec"):
            pass
        with torch.no_grad():
            assert (model(ids).logits - before).abs().max().item() == 0.0
        assert hfpatch.describe(model)["applied"]["position"]["scheme"] == "yarn"


def test_attention_path_counts_add_up_across_a_resume(tiny_run, tmp_path, monkeypatch, capsys):
    """A cell interrupted after some of its documents and resumed counts the attention paths of all of them, as an
    uninterrupted run does (the counts were saved only when a cell finished, so the resumed run's count covered the
    resumed documents alone)."""
    model_dir, docs = tiny_run
    common = ["--model", str(model_dir), "--text-files", str(docs), "--lengths", "32", "--tokens-per-doc", "96",
              "--max-docs", "2", "--patches", "alibi", "--no-plot"]
    assert perplexity.main([*common, "--out", str(tmp_path / "whole")]) == 0
    whole = json.loads((tmp_path / "whole" / "results.json").read_text())["cells"][0]["attention_path"]

    real = interrupt_document(monkeypatch, 2)  # the second document of the cell
    out = tmp_path / "resumed"
    assert perplexity.main([*common, "--out", str(out)]) == 130
    monkeypatch.setattr(sweep.Run, "document_nll", real)
    assert perplexity.main([*common, "--out", str(out)]) == 0
    resumed = json.loads((out / "results.json").read_text())["cells"][0]
    assert len(resumed["documents"]) == 2 and sum(whole.values()) > 0
    assert resumed["attention_path"] == whole
