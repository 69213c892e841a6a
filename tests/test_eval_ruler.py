"""eval ruler: every generator's answer key is right (needles where and what the question asks, distractors never
the answer, variable chains resolving to the stated names, word counts as the task claims), prompts fit their
length, scoring equals hand-scored examples, the Wilson interval equals the quadratic's roots, the command's
bookkeeping with an oracle in place of the model (resume included), bad input; SmolLM2 solves the noise NIAH."""

from __future__ import annotations

import collections
import json
import math
import random
import re

import pytest

from hfpatch.cli import main as cli_main
from hfpatch.evaluate import haystack as hs
from hfpatch.evaluate import sweep
from hfpatch.evaluate.evaluations import ruler
from hfpatch.evaluate.results import comparable as strip_timing
from hfpatch.evaluate.stats import wilson
from hfpatch.lm.causal import causal_lm_parts, greedy
from hfpatch.tiny import char_tokenizer as tiny_tokenizer
from hfpatch.tiny import save_sized as save_tiny


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HFPATCH_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def src():
    return hs.source(None)  # the default corpus: Python stdlib sources


NEEDLE = re.compile(r"One of the special magic (\w+) for (\S+) is: (\S+)\.")


@pytest.mark.parametrize("task", list(ruler.NIAH))
def test_niah_answer_keys(task, src):
    opts = ruler.NIAH[task]
    for i in range(3):
        s = ruler.generate(task, f"0:{task}:{i}", 300, src, 4096)
        found = NEEDLE.findall(s.input)
        by_key = collections.defaultdict(list)
        for kind, key, value in found:
            assert kind == opts["values"]
            by_key[key].append(value)
        queries = s.facts["queries"]
        assert len(queries) == opts["n_queries"] and all(q in s.input.split("\n")[-1] for q in queries)
        # the references are exactly the values of the asked keys, each written once, in a needle of that key
        assert sorted(s.references) == sorted(v for q in queries for v in by_key[q])
        assert len(s.references) == opts["n_queries"] * opts["n_values"]
        assert all(s.input.count(r) == 1 for r in s.references)
        # every other needle (other keys, distractors) has another key and a value that is not an answer
        others = [(k, v) for k, vals in by_key.items() if k not in queries for v in vals]
        assert all(v not in s.references for _, v in others)
        distractors = 300 if opts["haystack"] == "needle" else 0
        expected_others = (opts["n_keys"] - opts["n_queries"]) * opts["n_values"] + distractors
        assert len(others) == max(expected_others, 0)
        if opts["values"] == "numbers":
            assert all(re.fullmatch(r"\d{7}", r) for r in s.references)
        if opts["values"] == "uuids":
            assert all(re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", r)
                       for r in s.references)


@pytest.mark.parametrize("task", ["niah_single_2", "niah_multivalue"])
def test_essay_needles_sit_at_their_depths(task, src):
    """Real-text haystack: needle i goes before sentence int(len(sentences) * depth_i) of the haystack."""
    s = ruler.generate(task, "7", 400, src, 4096)
    context = s.input.split("\n")[1]
    units = hs.sentences(src.first_words(400))
    for needle, fraction in zip(s.facts["needles"], s.facts["fractions"]):
        before = context[: context.index(needle)]
        for other in s.facts["needles"]:  # the needles placed earlier are not haystack sentences
            before = before.replace(other, "")
        assert round(100 * fraction) in hs.DEPTHS
        assert len(hs.sentences(before)) == int(len(units) * fraction)


def test_noise_needle_position(src):
    s = ruler.generate("niah_single_1", "3", 50, src, 4096)
    lines = s.input.split("\n")[1:-1]
    at = next(i for i, line in enumerate(lines) if line.startswith("One of"))
    assert len(lines) == 51 and at == int(50 * s.facts["fractions"][0])
    assert all(line == hs.NOISE for i, line in enumerate(lines) if i != at)


def _resolve(lines: list[str], value: str) -> set[str]:
    """All variables that end up holding `value`, by reading the assignments (a fixed point, order-free)."""
    assign = {}
    for line in lines:
        m = re.fullmatch(r"VAR (\w+) = (VAR (\w+)|\d+)\s*", line)
        if m:
            assign[m.group(1)] = ("var", m.group(3)) if m.group(3) else ("num", m.group(2))

    def val(name, depth=0):
        kind, x = assign[name]
        return x if kind == "num" else val(x, depth + 1)

    return {name for name in assign if val(name) == value}


def test_variable_chains_resolve_to_the_answer(src):
    for i in range(5):
        s = ruler.generate("vt", f"0:vt:{i}", 40, src, 4096)
        example, real = s.input.split("\n\nMemorize", 1)[0], "Memorize" + s.input.split("\n\nMemorize", 1)[1]
        value = re.search(r"assigned the value (\d+) in the text above", real).group(1)
        assert _resolve(real.split("\n"), value) == set(s.references) and len(s.references) == 5
        assert s.answer_prefix.startswith(" Answer: According to the chain(s)") and f"value {value}," in s.answer_prefix
        # the worked example's answer is right too
        ex_value = re.search(r"assigned the value (\d+) in the text above", example).group(1)
        ex_answer = example.rsplit("they are: ", 1)[1].split()
        assert _resolve(example.split("\n"), ex_value) == set(ex_answer)
        assert sum(line.startswith("VAR") for line in real.split("\n")) == 5


@pytest.mark.parametrize("length,repeats", [(8192, (30, 3)), (2048, (6, 1))])
def test_common_words_counts(src, length, repeats):
    s = ruler.generate("cwe", "5", 120, src, length)
    real = s.input.split("\n")[-2]  # the numbered list of the question (after the worked example)
    items = re.findall(r"(\d+)\. (\w+)", real)
    assert [int(n) for n, _ in items] == list(range(1, len(items) + 1))
    counts = collections.Counter(w for _, w in items)
    assert len(counts) == 120 and len(s.references) == 10
    assert all(counts[w] == repeats[0] for w in s.references)
    assert all(c == repeats[1] for w, c in counts.items() if w not in s.references)
    # the worked example's answer is its own top 10
    example = s.input.split("\n")[1]
    ex_counts = collections.Counter(re.findall(r"\d+\. (\w+)", example))
    ex_answer = re.findall(r"\d+\. (\w+)", s.input.split("\n")[2])
    assert sorted(ex_answer) == sorted(w for w, _ in ex_counts.most_common(10))


def test_frequent_words_counts(src):
    s = ruler.generate("fwe", "9", 3000, src, 8192)
    text = s.input.split("coded words. ", 1)[1].split("\nQuestion:")[0]
    counts = collections.Counter(text.split(" "))
    ranked = [w for w, _ in counts.most_common() if w != "..."]
    assert counts.most_common(1)[0][0] == "..."  # the noise word is the most frequent
    assert ranked[:3] == s.references and counts[ranked[2]] > counts[ranked[3]]
    for k, w in enumerate(["...", *s.references], start=1):  # counts follow the Zipf law the task states
        assert counts[w] == int(3000 * k ** -2.0 / (math.pi ** 2 / 6))


def test_prompts_fit_their_length_and_are_the_largest():
    tok = tiny_tokenizer()
    src = hs.source(None)
    prompter = hs.Prompter(tok, chat=False)
    for task in ("niah_single_1", "niah_single_2", "vt", "fwe"):
        sizes = {}
        for i in range(2):
            _, ids = ruler.build(prompter, src, task, 3000, f"s{i}", sizes)
            n = sizes[(task, 3000)]
            assert len(ids) + ruler.TASKS[task][2] <= 3000
            bigger = ruler.generate(task, f"s{i}", n + 1, src, 3000)
            assert len(prompter.ids(bigger)) + ruler.TASKS[task][2] > 3000  # one more unit would not fit
            assert ids == prompter.ids(ruler.generate(task, f"s{i}", n, src, 3000))  # deterministic


def test_scoring_equals_hand_scores():
    refs = ["1234567", "7654321", "1111111"]
    assert hs.string_match_all("The numbers are 1234567 and 7654321.", refs) == pytest.approx(2 / 3)
    assert hs.string_match_all("none here", refs) == 0.0
    assert hs.string_match_all("A 1111111, 7654321; 1234567", refs) == 1.0
    assert hs.string_match_all("ANSWER: Sleepy-Owl", ["sleepy-owl"]) == 1.0  # case-insensitive
    assert hs.string_match_all("123456789", ["2345678"]) == 1.0  # a substring counts, as in RULER
    assert hs.string_match_part("only 7654321", refs) == 1.0 and hs.string_match_part("no", refs) == 0.0
    assert hs.postprocess("  abc\x00def\n ") == "abc\ndef"


@pytest.mark.parametrize("p,n", [(0.5, 10), (0.0, 5), (1.0, 20), (0.3, 7), (0.9, 200)])
def test_wilson_interval_is_the_score_test_inversion(p, n):
    """The Wilson interval is where (p_hat - p)^2 = z^2 p (1 - p) / n: the roots of that quadratic."""
    z = 1.959963984540054
    a, b, c = 1 + z * z / n, -(2 * p + z * z / n), p * p
    disc = math.sqrt(max(b * b - 4 * a * c, 0.0))
    lo, hi = wilson(p, n)
    assert lo == pytest.approx((-b - disc) / (2 * a), abs=1e-9) and hi == pytest.approx((-b + disc) / (2 * a), abs=1e-9)
    if (p, n) == (0.5, 10):
        assert (round(lo, 4), round(hi, 4)) == (0.2366, 0.7634)  # the textbook example


def test_cli_scores_tables_and_resume(tmp_path, monkeypatch, capsys):
    """Bookkeeping end to end with an oracle in place of decoding: it answers with the references when the prompt
    is at most 2,100 tokens (the shorter length), else with nothing; interrupted once, then resumed."""
    model_dir = save_tiny(tmp_path / "model")
    calls = []
    truth = {}

    def oracle(run, ids, new_tokens, eos, done=None):  # in place of the run's greedy decoding
        calls.append(len(ids))
        if len(calls) == 7 and "interrupt" in truth:
            raise KeyboardInterrupt
        refs = truth[tuple(ids)]
        right = len(ids) <= 2100
        return tiny_tokenizer()(" " + ", ".join(refs) if right else " no", add_special_tokens=False)["input_ids"]

    real_build = ruler.build

    def recording_build(prompter, src, task, length, seed, sizes):
        sample, ids = real_build(prompter, src, task, length, seed, sizes)
        truth[tuple(ids)] = sample.references
        return sample, ids

    monkeypatch.setattr(sweep.Run, "greedy", oracle)
    monkeypatch.setattr(ruler, "build", recording_build)
    argv = ["eval", "ruler", "--model", str(model_dir), "--tasks", "niah_single_1,niah_multivalue,vt",
            "--lengths", "2100,3000", "--samples", "2", "--patches", "none,yarn:2", "--out", str(tmp_path / "r")]
    truth["interrupt"] = True
    assert cli_main(argv) == 130
    partial = json.loads((tmp_path / "r" / "results.json").read_text())
    assert sum(len(c["samples"]) for c in partial["cells"]) == 6
    del truth["interrupt"]
    calls.clear()
    assert cli_main(argv) == 0
    assert len(calls) == 2 * 3 * 2 * 2 - 6  # only what was left
    out = capsys.readouterr().out
    res = json.loads((tmp_path / "r" / "results.json").read_text())
    assert len(res["cells"]) == 12 and all(c["complete"] and c["n"] == 2 for c in res["cells"])
    for c in res["cells"]:
        assert c["score"] == (1.0 if c["length"] == 2100 else 0.0)
        assert c["ci95"] == pytest.approx(list(wilson(c["score"], 2)))
    by = {(c["patch"], c["task"], c["length"]): [s["references"] for s in c["samples"]] for c in res["cells"]}
    assert by[("none", "vt", 3000)] == by[("yarn:2", "vt", 3000)]  # the same prompts for every spec
    assert "| niah_single_1 | 100 [34, 100] | 0 [0, 66] |" in out and "| **mean** | 100 [61, 100] | 0 [0, 39] |" in out
    assert (tmp_path / "r" / "ruler.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    monkeypatch.setattr(sweep.Run, "greedy", lambda *a: pytest.fail("a finished run decoded again"))
    assert cli_main(argv) == 0  # finished: only the report
    again = json.loads((tmp_path / "r" / "results.json").read_text())
    assert strip_timing(again) == strip_timing(res)

    # a later command adding one spec at one length reports every cell of the file, not only its own
    monkeypatch.setattr(sweep.Run, "greedy", oracle)
    capsys.readouterr()
    assert cli_main(["eval", "ruler", "--model", str(model_dir), "--tasks", "vt", "--lengths", "3000", "--samples",
                     "2", "--patches", "dynamic", "--out", str(tmp_path / "r"), "--no-plot"]) == 0
    tables = capsys.readouterr().out.split("**")
    shown = {tables[i]: tables[i + 1] for i in range(1, len(tables) - 1, 2) if tables[i] in ("none", "yarn:2",
                                                                                             "dynamic")}
    assert list(shown) == ["none", "yarn:2", "dynamic"]
    assert "| niah_single_1 | 100 [34, 100] | 0 [0, 66] |" in shown["none"]
    assert "| vt | — | 0 [0, 66] |" in shown["dynamic"]  # 2,100 tokens: not run for dynamic
    assert json.loads((tmp_path / "r" / "results.json").read_text())["settings"]["patches"] == ["dynamic"]


@pytest.mark.parametrize("argv,message", [
    (["--tasks", "niah_single_1,qa_1"], "unknown RULER task(s) qa_1"),
    (["--samples", "0"], "--samples must be >= 1"),
    (["--lengths", "300"], "at length 300: too short; its template and question take"),
    (["--chat-template"], "this tokenizer has no chat template"),
    (["--tasks", "vt,vt"], "--tasks repeats a task"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    model_dir = save_tiny(tmp_path / "model")
    capsys.readouterr()
    assert cli_main(["eval", "ruler", "--model", str(model_dir), "--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err, err


@pytest.mark.parametrize("task", ["niah_single_1", "vt", "cwe"])
def test_a_length_too_short_for_the_task_names_the_smallest_length_that_holds_it(tmp_path, capsys, task):
    """--lengths 10 said "more than -118 tokens": the limit is the length that holds the task's template and
    question (with the smallest haystack) and its generated tokens, a positive number of tokens."""
    model_dir = save_tiny(tmp_path / "model")
    capsys.readouterr()
    assert cli_main(["eval", "ruler", "--model", str(model_dir), "--tasks", task, "--lengths", "10",
                     "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{task} at length 10: too short" in err, err
    assert not re.search(r"-\d", err), err
    _, _, new, low = ruler.TASKS[task]
    smallest = ruler.generate(task, f"0:{task}:10:0", low, hs.source(None), 10)
    tokens = len(hs.Prompter(tiny_tokenizer(), chat=False).ids(smallest))
    assert f"take {tokens} tokens" in err and f"generates {new}: use lengths of at least {tokens + new}" in err, err


def test_smollm2_finds_the_noise_needle_at_1k(smollm2):
    """The real-model check: RULER's easiest task, well inside SmolLM2's window, with its real tokenizer."""
    model, tok = smollm2
    prompter, src, sizes = hs.Prompter(tok, chat=False), hs.source(None), {}
    parts = causal_lm_parts(model)
    scores = []
    for i in range(2):
        sample, ids = ruler.build(prompter, src, "niah_single_1", 1024, f"0:niah_single_1:1024:{i}", sizes)
        assert 850 <= len(ids) <= 1024 - 128
        answer = tok.decode(greedy(parts, ids, 16, {tok.eos_token_id}), skip_special_tokens=True)
        scores.append(hs.string_match_all(hs.postprocess(answer), sample.references))
    assert scores == [1.0, 1.0], scores


def test_same_seed_same_samples(src):
    a = ruler.generate("niah_multikey_1", "0:x", 200, src, 4096)
    b = ruler.generate("niah_multikey_1", "0:x", 200, src, 4096)
    c = ruler.generate("niah_multikey_1", "1:x", 200, src, 4096)
    assert (a.input, a.references) == (b.input, b.references) and a.references != c.references
    assert random.Random("0:x").random() == random.Random("0:x").random()  # str seeds: no hash randomization


def test_decoding_stops_once_every_reference_is_found():
    """The stop test ends decoding at the first token after which all references are in the answer; what was
    generated is the start of the full greedy answer, so the score is the full answer's (it cannot drop)."""
    from conftest import tiny_model

    tok = tiny_tokenizer()
    done = hs.all_found(tok, ["ab", "C"])
    assert not done(tok("x ab", add_special_tokens=False)["input_ids"])
    assert done(tok("x ab, c", add_special_tokens=False)["input_ids"])
    parts = causal_lm_parts(tiny_model("llama"))
    prompt = list(range(3, 40))
    full = greedy(parts, prompt, 20, set())
    refs = [tok.decode(full[3:5])]  # found once the 5th token is out
    cut = greedy(parts, prompt, 20, set(), hs.all_found(tok, refs))
    assert cut == full[: len(cut)] and len(cut) <= 5
    assert hs.string_match_all(tok.decode(cut), refs) == hs.string_match_all(tok.decode(full), refs) == 1.0
