"""The llama.cpp engine (`hfpatch eval ... --engine llama.cpp`) with a stand-in for llama-cpp-python, so that it runs
everywhere: tests/test_gguf_llamacpp.py checks the engine against the real llama.cpp, and skips where llama-cpp-python
is not installed; these check that the engine's model is built and scores and decodes through the interface it uses
(`Llama(path, n_ctx, logits_all=True, kv_overrides=...)`, `.eval`, `.scores`, `.n_tokens`, `.reset`, `.close`),
called end to end by `hfpatch eval ppl|passkey`.

The stand-in is a bigram model: the logits after a token are a fixed random vector of that token, so the NLL of a
window and the greedy continuation of a prompt are computed here independently of the engine's code."""

from __future__ import annotations

import json
import sys
import types
from typing import ClassVar

import numpy as np
import pytest
from conftest import stdlib_text

from hfpatch import spec as specs
from hfpatch.evaluate import evaluation
from hfpatch.evaluate.llamacpp import LlamaCppModel
from hfpatch.lm.tokenizer import load_tokenizer

pytest.importorskip("gguf", reason="the llama.cpp engine reads the GGUF file's metadata with the gguf package")

VOCAB = 49152  # SmolLM2's vocabulary: the stand-in's logits cover every token id the tokenizer gives


def bigram_logits(token: int) -> np.ndarray:
    """The stand-in model's logits after `token` (float32, as llama.cpp's scores)."""
    return (3 * np.random.default_rng(token).standard_normal(VOCAB)).astype(np.float32)


class StandInLlama:
    """llama_cpp.Llama as the engine uses it: a context of n_ctx tokens, .eval appends tokens and fills their rows
    of .scores."""

    made: ClassVar[list[StandInLlama]] = []

    def __init__(self, path: str, n_ctx: int, n_batch: int = 512, logits_all: bool = False, verbose: bool = True,
                 n_threads: int | None = None, n_threads_batch: int | None = None, kv_overrides: dict | None = None,
                 **params):
        assert logits_all, "the engine reads the logits of every position"
        # as llama_cpp.Llama does: the model parameters start from llama.cpp's defaults, read when it is built
        self.model_params = sys.modules["llama_cpp.llama_cpp"].llama_model_default_params()
        self.path, self.n_ctx, self.kv_overrides, self.params = path, n_ctx, kv_overrides, params
        self.scores = np.zeros((n_ctx, VOCAB), dtype=np.float32)
        self.n_tokens = 0
        self.closed = False
        StandInLlama.made.append(self)

    def reset(self) -> None:
        self.n_tokens = 0

    def eval(self, tokens: list[int]) -> None:
        if self.n_tokens + len(tokens) > self.n_ctx:
            raise RuntimeError(f"llama_decode: {self.n_tokens + len(tokens)} tokens in a context of {self.n_ctx}")
        for t in tokens:
            self.scores[self.n_tokens] = bigram_logits(int(t))
            self.n_tokens += 1

    def close(self) -> None:
        self.closed = True


def stand_in_default_params() -> types.SimpleNamespace:
    """llama.cpp's default model parameters, as far as the engine touches them: extra buffer types on."""
    return types.SimpleNamespace(use_extra_bufts=True)


@pytest.fixture
def stand_in(monkeypatch):
    """llama_cpp and its native bindings llama_cpp.llama_cpp in sys.modules are the stand-in, for the engine's lazy
    imports."""
    native = types.ModuleType("llama_cpp.llama_cpp")
    native.llama_model_default_params = stand_in_default_params  # type: ignore[attr-defined]
    module = types.ModuleType("llama_cpp")
    module.__path__ = []  # a package, as the real one is
    module.Llama = StandInLlama  # type: ignore[attr-defined]
    module.llama_cpp = native  # type: ignore[attr-defined]
    module.__version__ = "0.0+standin"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_cpp", native)
    StandInLlama.made = []
    return StandInLlama


def expected_nll(window: list[int], first: int) -> float:
    """Sum of -log p(window[i] | window[i-1]) for i >= first, in float64: what the engine must compute."""
    total = 0.0
    for prev, target in zip(window[first - 1 : -1], window[first:], strict=True):
        x = bigram_logits(prev).astype(np.float64)
        total += float(np.log(np.exp(x - x.max()).sum()) + x.max() - x[target])
    return total


def expected_greedy(last: int, new_tokens: int, eos: set) -> list[int]:
    """The bigram model's greedy continuation after a prompt ending in `last`, cut after an EOS token."""
    out: list[int] = []
    while len(out) < new_tokens:
        last = int(np.argmax(bigram_logits(last)))
        out.append(last)
        if last in eos:
            break
    return out


def test_engine_model_scores_windows_as_llama_cpps_logits_give(stand_in, smollm2_gguf):
    ids = np.random.default_rng(0).integers(0, VOCAB, 200).tolist()
    spans = [(0, 64, 1), (50, 114, 14), (114, 200, 1)]  # (start, end, first scored): a window, a strided one, a third
    model = LlamaCppModel(smollm2_gguf, threads=1)
    try:
        with model.applied({}, "none"):
            total, count, runs = model.document_nll(ids, spans)
    finally:
        model.close()
    want = sum(expected_nll(ids[start:end], first) for start, end, first in spans)
    assert total == pytest.approx(want, rel=1e-9)
    assert count == sum(end - start - first for start, end, first in spans)
    assert runs == [(start + first, end) for start, end, first in spans]
    assert all(llm.closed for llm in stand_in.made)  # closing the model closes its contexts


def test_engine_builds_contexts_with_the_weights_as_stored_and_restores_llama_cpps_defaults(stand_in, smollm2_gguf):
    """Extra buffer types (load-time repacking of the weights) are off in every context the engine builds, and
    llama.cpp's defaults are what they were once it is built."""
    model = LlamaCppModel(smollm2_gguf, threads=1)
    try:
        with model.applied({}, "none"):
            model.document_nll(list(range(1, 33)), [(0, 32, 1)])
    finally:
        model.close()
    assert stand_in.made and all(llm.model_params.use_extra_bufts is False for llm in stand_in.made)
    assert sys.modules["llama_cpp.llama_cpp"].llama_model_default_params is stand_in_default_params


def test_engine_model_decodes_greedily_on_its_kv_cache_and_stops_at_eos(stand_in, smollm2_gguf):
    prompt = np.random.default_rng(1).integers(0, VOCAB, 40).tolist()
    chain = expected_greedy(prompt[-1], 8, set())
    model = LlamaCppModel(smollm2_gguf, threads=1)
    try:
        with model.applied({}, "none"):
            assert model.greedy(prompt, 8, set()) == chain
            # the prompt was evaluated once, then each token but the last generated one
            assert stand_in.made[-1].n_tokens == len(prompt) + len(chain) - 1
            assert model.greedy(prompt, 8, {chain[2]}) == chain[:3]
            assert model.greedy(prompt, 8, set(), done=lambda generated: len(generated) == 5) == chain[:5]
    finally:
        model.close()


def test_a_spec_reaches_llama_cpp_as_the_metadata_overrides_of_its_context(stand_in, smollm2_gguf):
    model = LlamaCppModel(smollm2_gguf, threads=1)
    try:
        with model.applied(specs.parse("yarn:2"), "yarn:2"):
            overrides = dict(model.setting.kv_overrides)
            model.document_nll(list(range(1, 33)), [(0, 32, 1)])
    finally:
        model.close()
    assert overrides and stand_in.made[-1].kv_overrides == overrides
    assert any(key.endswith("rope.scaling.type") for key in overrides)


def test_eval_ppl_and_passkey_run_end_to_end_in_the_llama_cpp_engine(stand_in, tmp_path, monkeypatch):
    """The commands build the engine's model and call its document_nll and greedy: the cells complete, and the
    passkey's answer is the stand-in's greedy continuation of the prompt."""
    monkeypatch.setenv("HFPATCH_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "text.txt"
    text.write_text(stdlib_text(20_000))
    assert evaluation("ppl").main(["--engine", "llama.cpp", "--lengths", "128", "--patches", "none,yarn:2",
                                   "--text-files", str(text), "--tokens-per-doc", "256", "--no-plot",
                                   "--out", str(tmp_path / "ppl")]) == 0
    data = json.loads((tmp_path / "ppl" / "results.json").read_text())
    assert data["model"]["engine"] == "llama.cpp" and data["model"]["llama_cpp_python"] == "0.0+standin"
    assert [c["patch"] for c in data["cells"]] == ["none", "yarn:2"]
    assert all(c["complete"] and c["tokens"] == 2 * 127 for c in data["cells"])
    # random bigram logits: about ln(vocab) plus the spread of 3 x N(0, 1) logits per token
    assert all(np.isfinite(c["mean_nll"]) and c["mean_nll"] > 5 for c in data["cells"])

    assert evaluation("passkey").main(["--engine", "llama.cpp", "--lengths", "256", "--depths", "0.5", "--trials",
                                       "1", "--patches", "none", "--no-plot", "--out", str(tmp_path / "pk")]) == 0
    cell = json.loads((tmp_path / "pk" / "results.json").read_text())["cells"][0]
    tok = load_tokenizer("smollm2")
    last = tok("What is the pass key? The pass key is")["input_ids"][-1]  # every prompt ends with the question
    eos = {i for i in [tok.eos_token_id] if i is not None}
    want = tok.decode(expected_greedy(last, 12, eos), skip_special_tokens=True)
    assert cell["complete"] and [t["answer"] for t in cell["trials"]] == [want]
