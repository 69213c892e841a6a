"""eval passkey: the prompt (length, depth, key), greedy decoding with a KV cache equal to decoding without one,
scoring, the table/heatmap/JSON bookkeeping with resume, errors; and SmolLM2 finding a key at 1k tokens."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from conftest import cli_answered_by, tiny_model

import hfpatch
from hfpatch.cli import main as cli_main
from hfpatch.evaluate.evaluations.passkey import FILLER, build_prompt, is_correct, make_key
from hfpatch.evaluate.results import comparable as strip_timing
from hfpatch.lm.causal import causal_lm_parts, greedy
from hfpatch.tiny import char_tokenizer as tiny_tokenizer
from hfpatch.tiny import save_sized as save_tiny


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HFPATCH_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("length,depth", [(300, 0.0), (300, 0.5), (700, 1.0), (1000, 0.3)])
def test_prompt_fits_the_length_and_places_the_key(length, depth):
    tok = tiny_tokenizer()
    ids, n = build_prompt(tok, length, depth, "68431")
    text = tok.decode(ids)
    assert len(ids) <= length < len(ids) + len(FILLER) + 1  # one more filler sentence would not fit
    assert text.count(FILLER) == n and text.endswith("What is the pass key? The pass key is")
    before = text[: text.index("The pass key is 68431. Remember it. 68431 is the pass key.")].count(FILLER)
    assert before == round(depth * n)


def test_prompt_longer_than_the_length_is_an_error():
    with pytest.raises(ValueError, match="shorter than the passkey prompt"):
        build_prompt(tiny_tokenizer(), 100, 0.5, "68431")


@pytest.mark.parametrize("family,position", [("llama", None), ("llama", "yarn"), ("gpt2", None), ("gemma2", None)])
def test_greedy_with_kv_cache_equals_recomputing_everything(family, position):
    model = tiny_model(family)
    if position:
        hfpatch.patch(model, position=position, factor=2.0)
    prompt = torch.randint(3, 101, (40,), generator=torch.Generator().manual_seed(5)).tolist()  # + 9 <= 64 (gpt2)
    got = greedy(causal_lm_parts(model), prompt, 9, eos=set())
    ids, expected = list(prompt), []
    with torch.no_grad():
        for _ in range(9):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            expected.append(nxt)
            ids.append(nxt)
    assert got == expected


def test_greedy_hands_the_cache_back_under_the_name_the_forward_takes():
    """transformers renamed past_key_values to cache (the old name warns, and goes in a later release): decoding
    passes the name the model's forward lists, so no deprecation warning is raised."""
    model = tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        greedy(causal_lm_parts(model), list(range(3, 40)), 4, eos=set())


def test_greedy_decodes_without_building_a_graph():
    """Decoding a long prompt must not keep autograd's graph (memory grows with every step otherwise)."""
    model = tiny_model("llama")
    grad_modes = []
    model.get_input_embeddings().register_forward_hook(lambda m, a, out: grad_modes.append(torch.is_grad_enabled()))
    greedy(causal_lm_parts(model), list(range(3, 40)), 3, eos=set())
    assert grad_modes and not any(grad_modes)


def test_greedy_stops_at_eos():
    model = tiny_model("llama")
    prompt = list(range(3, 40))
    first = greedy(causal_lm_parts(model), prompt, 1, eos=set())[0]
    assert greedy(causal_lm_parts(model), prompt, 9, eos={first}) == [first]


def check_keys(make_key):
    """What the keys must be: reproducible (resume, every patch spec), 5 digits without a leading zero, different
    from trial to trial, and different again for another seed, length or depth."""
    keys = [make_key(0, 1024, 0.5, t, 5) for t in range(20)]
    assert keys == [make_key(0, 1024, 0.5, t, 5) for t in range(20)]
    # (the keys are fixed by their seeds, so "all different" is checked once for these 20, not left to chance)
    assert all(len(k) == 5 and k.isdigit() and k[0] != "0" for k in keys) and len(set(keys)) == 20
    for changed in ((1, 1024, 0.5), (0, 2048, 0.5), (0, 1024, 0.0)):  # seed, length, depth
        other = [make_key(*changed, t, 5) for t in range(20)]
        assert all(a != b for a, b in zip(keys, other)), changed
    assert all(len(make_key(0, 1024, 0.5, 0, d)) == d for d in (1, 3, 8))


def test_keys_and_scoring():
    check_keys(make_key)
    # the check fails on broken copies of make_key (the assertion this replaces, "a differs or b differs", let
    # the first one through: only trial 0 ignored the seed)
    broken = {
        "seed ignored for trial 0": lambda s, n, d, t, k: make_key(0 if t == 0 else s, n, d, t, k),
        "seed ignored": lambda s, n, d, t, k: make_key(0, n, d, t, k),
        "length ignored": lambda s, n, d, t, k: make_key(s, 1024, d, t, k),
        "one key per cell": lambda s, n, d, t, k: make_key(s, n, d, 0, k),
        "leading zeros": lambda s, n, d, t, k: str(int(make_key(s, n, d, t, k)) % 10**(k - 1)).zfill(k),
    }
    for copy in broken.values():
        with pytest.raises(AssertionError):
            check_keys(copy)
    assert is_correct(" 68431. Remember", "68431") and is_correct("it is 1, 68431", "68431")
    assert not is_correct(" 684312", "68431") and not is_correct(" 6843", "68431") and not is_correct("", "68431")


def test_cli_table_heatmap_json_and_resume(tmp_path, monkeypatch, capsys):
    """Bookkeeping end to end with an oracle in place of decoding: it answers right when the key sits in the first
    half of the prompt, so the expected accuracy of every cell is known."""
    model_dir = save_tiny(tmp_path / "model")
    tok = tiny_tokenizer()
    calls = []

    def oracle(run, ids, new_tokens, eos, done=None):  # in place of the run's greedy decoding
        calls.append(len(ids))
        text = tok.decode(ids)
        key = re.search(r"The pass key is (\d+)\. Remember", text)
        right = key.start() < len(text) / 2
        return tok(" " + (key.group(1) if right else "12"), add_special_tokens=False)["input_ids"]

    argv = ["eval", "passkey", "--model", str(model_dir), "--lengths", "600,1000", "--depths", "0,0.4,1",
            "--trials", "2", "--patches", "none,yarn:2", "--out", str(tmp_path / "pk")]
    out = cli_answered_by(monkeypatch, capsys, oracle, argv)
    res = json.loads((tmp_path / "pk" / "results.json").read_text())
    assert len(res["cells"]) == 2 * 2 * 3 and len(calls) == 2 * 2 * 3 * 2
    for c in res["cells"]:
        assert len(c["trials"]) == 2 and all(t["prompt_tokens"] <= c["length"] for t in c["trials"])
        assert c["accuracy"] == (1.0 if c["depth"] < 0.5 else 0.0)
        assert all(t["correct"] == (c["depth"] < 0.5) for t in c["trials"])
    keys = {(c["patch"], c["length"], c["depth"]): [t["key"] for t in c["trials"]] for c in res["cells"]}
    assert keys[("none", 600, 0.4)] == keys[("yarn:2", 600, 0.4)]  # same keys for every patch spec
    assert "| 0.4 | 1.00 | 1.00 |" in out and "| 1 | 0.00 | 0.00 |" in out and "| **mean** | 0.67 | 0.67 |" in out
    assert (tmp_path / "pk" / "passkey.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    calls.clear()  # rerun: nothing left to do, same results
    assert cli_main(argv) == 0 and not calls
    assert strip_timing(json.loads((tmp_path / "pk" / "results.json").read_text())) == strip_timing(res)
    calls.clear()  # one more trial per cell: only those run
    assert cli_main([a if a != "2" else "3" for a in argv]) == 0  # --trials 3
    assert len(calls) == 12


@pytest.mark.parametrize("argv,message", [
    (["--depths", "0,1.5"], "--depths must be numbers between 0 and 1"),
    (["--lengths", "64"], "shorter than the passkey prompt without filler (247 tokens): use lengths of at least 247"),
    (["--patches", "none,yarm:2"], "unknown position scheme 'yarm'"),
    (["--trials", "0"], "--trials must be >= 1"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    model_dir = save_tiny(tmp_path / "model")
    capsys.readouterr()  # what saving printed
    assert cli_main(["eval", "passkey", "--model", str(model_dir), "--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err, err


def test_smollm2_finds_the_key_at_1k_tokens(smollm2):
    """The one real-model test: the prompt and decoding work with a real tokenizer and model, inside its window."""
    model, tok = smollm2
    parts = causal_lm_parts(model)
    found = []
    for depth in (0.2, 0.8):
        key = make_key(0, 1024, depth, 0, 5)
        ids, _ = build_prompt(tok, 1024, depth, key)
        assert 1000 <= len(ids) <= 1024
        answer = tok.decode(greedy(parts, ids, 7, {tok.eos_token_id}), skip_special_tokens=True)
        found.append(is_correct(answer, key))
    assert all(found), found
