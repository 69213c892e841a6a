"""Tiny random models of every supported family, built from configs (no downloads), and shared helpers."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import transformers

import hfpatch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "gpt_neox",
            "gpt2", "opt", "bert"]
ROPE_FAMILIES = FAMILIES[:10]
WINDOW = 64  # trained window of the tiny models; tests run past it
VOCAB = 101

REPO = Path(__file__).resolve().parents[1]
BOOKS = Path(os.environ.get("HFPATCH_BOOKS", REPO.parent / "shared" / "data" / "books"))


def tiny_config(family: str, **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=WINDOW, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    per_family = {
        "gpt2": dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=WINDOW, bos_token_id=1,
                     eos_token_id=2),
        "opt": dict(common, ffn_dim=128, word_embed_proj_dim=64),
        "bert": dict(common),
        "gpt_neox": dict(common, hidden_size=128, partial_rotary_factor=0.25),  # head 32, 8 rotated channels
        "phi3": dict(common, original_max_position_embeddings=WINDOW),
        "gemma2": dict(common, num_key_value_heads=2, head_dim=16, sliding_window=16),
        "gemma3_text": dict(common, num_key_value_heads=2, head_dim=16, sliding_window=16,
                            layer_types=["sliding_attention", "full_attention"]),
    }
    kw = per_family.get(family, dict(common, num_key_value_heads=2))
    kw.update(overrides)
    return AutoConfig.for_model(family, **kw)


def build(config, seed=0):
    torch.manual_seed(seed)
    cls = AutoModelForMaskedLM if config.model_type == "bert" else AutoModelForCausalLM
    model = cls.from_config(config).eval()
    # Random norm weights, so that tests notice a norm that is lost or mis-scaled (init would be all ones/zeros).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def tiny_model(family: str, seed=0, **overrides):
    return build(tiny_config(family, **overrides), seed)


def native_model(family: str, weights_from, rope_parameters, max_position_embeddings, **overrides):
    """A model of `family` configured natively by transformers with these rope_parameters, carrying the weights of
    `weights_from`. Phi3Config rewrites/rejects rope types other than default/longrope at construction, so for those
    the parameters are assigned after construction, which is what its rotary class then reads."""
    try:
        cfg = tiny_config(family, rope_parameters=copy.deepcopy(rope_parameters),
                          max_position_embeddings=max_position_embeddings, **overrides)
    except Exception:  # phi3 refuses the type (or rewrites yarn to longrope)
        cfg = tiny_config(family, max_position_embeddings=max_position_embeddings, **overrides)
    wanted = rope_parameters.get("rope_type") or rope_parameters.get("full_attention", {}).get("rope_type")
    have = cfg.rope_parameters.get("rope_type") or cfg.rope_parameters.get("full_attention", {}).get("rope_type")
    if have != wanted:
        cfg.rope_parameters = copy.deepcopy(rope_parameters)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.load_state_dict(weights_from.state_dict())
    return model


def tokens(n=160, batch=1, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, n), generator=g)


@torch.no_grad()
def logits(model, ids):
    return model(ids).logits


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def fingerprint(model):
    """Everything a patch could change: every parameter and buffer (persistent or not), the class of every module,
    every plain attribute of every module, and the config."""
    tensors = {n: t.detach().clone() for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    classes = {n: type(m) for n, m in model.named_modules()}
    plain = (int, float, str, bool, type(None), dict, list, tuple)
    attrs = {n: {k: copy.deepcopy(v) for k, v in vars(m).items() if not k.startswith("_") and isinstance(v, plain)}
             for n, m in model.named_modules()}
    configs = {n: getattr(m, "config", None) for n, m in model.named_modules() if hasattr(m, "config")}
    return tensors, classes, attrs, {n: c.to_dict() if c is not None else None for n, c in configs.items()}, \
        {n: id(c) for n, c in configs.items()}


def assert_same_fingerprint(a, b):
    ta, ca, aa, cfa, ida = a
    tb, cb, ab, cfb, idb = b
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), f"tensor {k} changed"
    assert ca == cb, "module classes changed"
    assert aa == ab, "module attributes changed"
    assert cfa == cfb, "config changed"
    assert ida == idb, "a module now reads another config object"


@pytest.fixture(scope="session")
def books():
    if not BOOKS.is_dir():
        pytest.skip(f"real-text tests need the books folder {BOOKS} (set HFPATCH_BOOKS to another folder)")
    return BOOKS


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model (SmolLM2-135M, GGUF -> fp32) and its tokenizer, loaded once per session."""
    from hfpatch.models import SMOLLM2, load

    try:
        from hfpatch.models import smollm2_path

        smollm2_path()
    except ValueError as e:
        pytest.skip(str(e))
    model, tok = load(SMOLLM2)
    return model.eval(), tok


def stdlib_text(chars=400_000) -> str:
    """Real text that every install has: Python standard library sources."""
    from hfpatch.text import default_corpus

    text = ""
    for doc in default_corpus():
        text += doc.text
        if len(text) >= chars:
            break
    return text[:chars]


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer (vocabulary 384) trained on stdlib text by recipes/train_tokenizer.py."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_tokenizer", REPO / "recipes" / "train_tokenizer.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    base = tmp_path_factory.mktemp("tokenizer")
    (base / "text.txt").write_text(stdlib_text(200_000))
    assert script.main(["--text-files", str(base / "text.txt"), "--vocab-size", "384", "--out", str(base / "tok")]) == 0
    return base / "tok"


def pytest_sessionstart(session):
    """The versions under test, on the first line of every run (also with -q, which hides pytest's own header)."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"hfpatch {hfpatch.__version__}, transformers {transformers.__version__}, "
                            f"torch {torch.__version__}")
