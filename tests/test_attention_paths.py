"""The attention paths of the schemes with their own attention function (ALiBi, T5, XL, Self-Extend): every fast
path equals the written-out path on the same inputs (GQA, padding, a KV cache, generate), in fp32 and in low
precision; the table picks the path the device, dtype and grad mode allow; bf16/fp16 models of every scheme stay
finite and close to fp32.

flex_attention runs uncompiled here (its reference implementation computes the same scores, and on the CPU it is the
only one that returns the log-sum-exp); the few tests that compile are marked slow. CUDA and flash-attn paths are
checked for their selection here and numerically only where a GPU is present."""

import contextlib
import json
import warnings
from collections import Counter

import pytest
import torch
from conftest import WINDOW, max_diff, tiny_model, tokens
from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException
from torch.nn.attention.flex_attention import flex_attention

import hfpatch
from hfpatch.cli import main as cli_main
from hfpatch.position.attention import flex, kernels, paths


def CUDA(test):
    """A test of a CUDA-only path: marked `cuda` (pytest -m cuda selects them: eval/gpu_check.sh), skipped here."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the path runs on CUDA only)")
    return pytest.mark.cuda(skip(test))


FLASH = pytest.mark.skipif(kernels.flash_attn_missing() is not None,
                           reason=f"needs flash-attn on CUDA ({kernels.flash_attn_missing()})")

# the relative error, max |a - b| / max |b|, each dtype's fast path keeps to the written-out path of the same dtype.
# fp32: the kernels' own rounding (measured <= 2e-6). bf16/fp16: both sides round scores and weights to 8/11 bits, in
# different places (the written-out path rounds the bias to the dtype before adding it, the kernels add it in
# float32); measured up to 2.6e-2 (bf16) and 1.9e-3 (fp16), both Transformer-XL, where the written-out side is the
# less accurate one (bf16 against float32: widened 6.4e-3, written-out 3.0e-2).
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}
# a whole tiny model in bf16/fp16 against the same model in fp32, relative to the largest logit (measured up to
# 7.2e-3 and 1.0e-3 over every scheme)
MODEL_TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}

SCHEME_KW = {"alibi": {}, "t5": {"num_buckets": 8, "max_distance": 20}, "xl": {},
             "self-extend": {"group_size": 3, "window": 16}, "dual-chunk": {"chunk_size": 24, "local_window": 4}}


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # uncompiled flex warns that it writes the scores out
        yield


@pytest.fixture
def reference_flex(monkeypatch):
    """flex paths run flex_attention uncompiled (same scores, no compilation), without marking it compiled."""
    monkeypatch.setattr(flex, "compiled_fn", lambda: flex_attention)
    monkeypatch.setattr(flex, "_timings", {})


def patched(scheme, dtype=torch.float32, family="llama", attn=None, **kw):
    model = tiny_model(family).to(dtype)
    if attn is not None:  # as if loaded with attn_implementation=attn
        model.config._attn_implementation_internal = attn
    model = hfpatch.patch(model, position=scheme, **{**SCHEME_KW[scheme], **kw})
    if scheme == "t5":  # zero at start; give every bucket its own bias
        with torch.no_grad():
            model.base_model.hfpatch_t5_bias.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(3))
    if scheme == "xl":
        torch.manual_seed(4)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "hfpatch_xl" in name:
                    p.normal_(0.0, 0.2)
    return model


def inputs(q_len, kv_len, dtype, heads=4, kv_heads=2, d=16, batch=2, pad=0, seed=0):
    """q/k/v and a bool mask [b, 1, q, kv] (True = attend): causal by slot, the first `pad` keys of the second
    sequence padded (left padding), or None where transformers gives none; and which query rows see some key."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, d, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, kv_len, d, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, kv_len, d, generator=g).to(dtype)
    slots = torch.arange(kv_len)
    mask = (slots[None, :] <= slots[kv_len - q_len:, None])[None, None].repeat(batch, 1, 1, 1)
    mask[1, :, :, :pad] = False
    given = pad or 1 < q_len < kv_len  # transformers passes no mask only where sdpa's is_causal is right
    return q, k, v, (mask if given else None), mask.any(-1)[:, 0]


def run_path(scheme, name, module, q, k, v, mask, causal=True, softcap=None):
    """The named path's output [b, q, H, d] on these inputs, through the table (so its conditions are checked)."""
    with torch.no_grad(), paths.forcing(scheme, name):
        out, _ = paths.run(scheme, module, q, k, v, mask, scaling=q.shape[-1] ** -0.5, dropout=0.0, causal=causal,
                           kwargs={"softcap": softcap} if softcap else {})
    return out


def rel(a, b, rows):
    a, b = a.float()[rows], b.float()[rows]  # [b, q, H, d] -> [real rows, H, d]
    return ((a - b).abs().max() / b.abs().max()).item()


# ------------------------------------------------------------------------------------------- fast == written-out

CASES = [  # (q_len, kv_len, pad): no cache, a KV cache (queries are the last q_len slots), a decoding step
    (160, 160, 0), (160, 160, 23), (37, 200, 0), (37, 200, 23), (1, 90, 11)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_len,kv_len,pad", CASES)
@pytest.mark.parametrize("scheme,fast", [("alibi", "factorised"), ("alibi", "flex"), ("t5", "pieces"),
                                         ("t5", "flex"), ("xl", "widened"), ("self-extend", "pieces")])
def test_fast_path_equals_the_written_out_path(scheme, fast, q_len, kv_len, pad, dtype, reference_flex):
    model = patched(scheme, dtype)
    attn = model.model.layers[0].self_attn
    q, k, v, mask, real = inputs(q_len, kv_len, dtype, pad=pad)
    got = run_path(scheme, fast, attn, q, k, v, mask)
    want = run_path(scheme, "written-out", attn, q, k, v, mask)
    assert torch.isfinite(got[real.nonzero(as_tuple=True)]).all()
    assert rel(got, want, real) <= TOL[dtype]


@pytest.mark.parametrize("q_len,kv_len,pad", [(160, 160, 23), (37, 200, 0)])
def test_self_extend_two_flex_calls_merged_by_lse_equal_the_written_out_path(q_len, kv_len, pad, reference_flex):
    """The CUDA flex path's arithmetic (two region masks, lse merge), run by the reference flex here."""
    model = patched("self-extend")
    attn = model.model.layers[0].self_attn
    q, k, v, mask, real = inputs(q_len, kv_len, torch.float32, pad=pad)
    call = paths.call_of(attn, q, k, v, mask, 0.0, True, None)
    flex_path = next(p for p in paths.table("self-extend") if p.name == "flex")
    assert paths.refusal(flex_path, call) == "runs on cuda, not cpu"
    with torch.no_grad():
        got = flex_path.run(attn, q, k, v, mask, scaling=0.25, dropout=0.0, causal=True, softcap=None, kwargs={})
    want = run_path("self-extend", "written-out", attn, q, k, v, mask)
    assert rel(got, want, real) <= 1e-5


@pytest.mark.parametrize("scheme", ["alibi", "t5"])
def test_flex_handles_bidirectional_attention_and_softcapping(scheme, reference_flex):
    model = patched(scheme)
    attn = model.model.layers[0].self_attn
    q, k, v, _, _ = inputs(120, 120, torch.float32)
    keep = torch.ones(2, 1, 120, 120, dtype=torch.bool)
    keep[1, :, :, -17:] = False  # right padding of a bidirectional encoder
    real = torch.ones(2, 120, dtype=torch.bool)
    for causal, softcap, mask in ((False, None, keep), (True, 5.0, None), (False, 2.0, None)):
        got = run_path(scheme, "flex", attn, q * 3, k, v, mask, causal=causal, softcap=softcap)
        want = run_path(scheme, "written-out", attn, q * 3, k, v, mask, causal=causal, softcap=softcap)
        assert rel(got, want, real) <= 1e-5, (causal, softcap)


def test_t5_band_is_where_the_buckets_stop_changing():
    from hfpatch.position.schemes.relative import t5_band, t5_buckets

    model = patched("t5", num_buckets=32, max_distance=128)
    bias = model.model.layers[0].self_attn.hfpatch_t5
    D = t5_band(bias)
    buckets = t5_buckets(-torch.arange(1000), False, 32, 128)
    assert buckets[D - 1] != 31 and (buckets[D:] == 31).all()
    assert 1 <= D <= 128


# ---------------------------------------------------------------------------------- models: cache and generate

@pytest.mark.parametrize("scheme,fast", [("alibi", "factorised"), ("t5", "pieces"), ("self-extend", "pieces"),
                                         ("alibi", "flex"), ("t5", "flex")])
def test_generate_and_cached_decoding_match_the_written_out_path(scheme, fast, reference_flex):
    model = patched(scheme)
    ids = tokens(60, batch=2)
    keep = torch.ones(2, 60, dtype=torch.long)
    keep[1, :9] = 0  # left padding, as generate() pads
    kw = dict(attention_mask=keep, max_new_tokens=5, do_sample=False, pad_token_id=0, output_scores=True,
              return_dict_in_generate=True)
    results = {}
    for name in (fast, "written-out"):
        paths.reset(model)
        with torch.no_grad(), paths.forcing(scheme, name):
            results[name] = model.generate(ids, **kw)
        assert set(paths.ran(model)) == {name}  # the prompt and every decoding step ran it
    assert torch.equal(results[fast].sequences, results["written-out"].sequences)
    for a, b in zip(results[fast].scores, results["written-out"].scores):
        assert max_diff(a, b) <= 1e-4


def test_describe_and_the_default_choice_on_this_cpu():
    """Inference takes the fast path (XL: the written-out one for short sequences); training the written-out one,
    except ALiBi (its sdpa-based path passes gradients), T5 and Dual Chunk Attention (their piece paths do) and XL
    (its recomputed path); describe() reports both."""
    for scheme, fast in (("alibi", "factorised"), ("t5", "pieces"), ("self-extend", "pieces"), ("xl", "written-out"),
                         ("dual-chunk", "pieces")):
        model = patched(scheme)
        x = tokens(40, batch=2)
        paths.reset(model)
        with torch.no_grad():
            model(x)
        info = hfpatch.describe(model)["position"]["attention_path"]
        assert info["ran"] == {fast: 2}, scheme  # two layers, one call each
        assert info["order"][-1] == "written-out"
        model.train()
        model(x, labels=x).loss.backward()
        training = {"alibi": "factorised", "xl": "recomputed", "t5": "pieces", "dual-chunk": "pieces"}.get(
            scheme, "written-out")
        assert paths.ran(model) == dict(Counter({fast: 2}) + Counter({training: 2})), scheme
    assert "attention_path" not in hfpatch.describe(hfpatch.patch(tiny_model("llama"), position="nope"))["position"]


# -------------------------------------------------------------------------------------------------- selection

def call(device="cpu", dtype=torch.float32, grad=False, dropout=False, softcap=False, causal=True, mask="none",
         q_len=4096, kv_len=4096, base="sdpa"):
    return paths.Call(device, dtype, grad, dropout, softcap, causal, mask, q_len, kv_len, base)


@contextlib.contextmanager
def flash_attn_present(monkeypatch):
    """As on a CUDA machine with flash-attn installed (for the selection logic only)."""
    import importlib.machinery
    import importlib.util

    find = importlib.util.find_spec
    installed = importlib.machinery.ModuleSpec("flash_attn", None, origin="/site/flash_attn/__init__.py")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: installed if name == "flash_attn" else
                        find(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    yield


SELECTION = [
    # scheme, call, path taken
    ("alibi", call(), "factorised"),
    ("alibi", call(grad=True, dropout=True), "factorised"),
    ("alibi", call(softcap=True), "flex"),  # inference on the CPU
    ("alibi", call(softcap=True, grad=True), "written-out"),  # compiled flex has no backward on the CPU
    ("alibi", call(causal=False, mask="bool"), "flex"),
    ("alibi", call(causal=False, mask="float"), "written-out"),
    ("alibi", call(softcap=True, q_len=64, kv_len=64), "written-out"),  # too small to compile for
    ("alibi", call("cuda", torch.bfloat16), "flex"),
    ("alibi", call("cuda", torch.bfloat16, grad=True), "flex"),
    ("alibi", call("cuda", torch.bfloat16, base="flash_attention_2"), "flash-attn"),
    ("alibi", call("cuda", torch.bfloat16, grad=True, dropout=True, base="flash_attention_2"), "flash-attn"),
    ("alibi", call("cuda", torch.bfloat16, mask="bool", base="flash_attention_2"), "flex"),  # padding
    ("alibi", call("cuda", torch.bfloat16, dropout=True, grad=True), "written-out"),
    ("alibi", call("cuda", torch.float32, base="flash_attention_2"), "flex"),
    ("t5", call(), "pieces"),
    ("t5", call(mask="bool", q_len=1), "pieces"),
    ("t5", call(grad=True), "pieces"),
    ("t5", call(grad=True, causal=False), "written-out"),  # the pieces are causal; flex has no CPU backward
    ("t5", call(causal=False), "flex"),
    ("t5", call("cuda", torch.float16), "flex"),
    ("t5", call("cuda", torch.float16, grad=True), "flex"),
    ("t5", call("cuda", torch.float16, q_len=1), "pieces"),
    ("xl", call(), "widened"),
    ("xl", call(q_len=2048, kv_len=2048), "written-out"),  # faster below about 3k
    ("xl", call(grad=True), "recomputed"),  # O(block x L) memory, and faster than widened on the CPU
    ("xl", call(grad=True, dropout=True, causal=False, mask="float", q_len=64, kv_len=64), "widened"),  # memory
    ("xl", call(softcap=True), "written-out"),
    ("xl", call("cuda", torch.bfloat16, base="flash_attention_2"), "written-out"),
    ("xl", call("cuda", torch.bfloat16, grad=True), "recomputed"),  # no [L, L] weights kept for the backward
    ("xl", call("cuda", torch.bfloat16, grad=True, dropout=True), "written-out"),
    ("dual-chunk", call(grad=True), "pieces"),
    ("dual-chunk", call("cuda", torch.bfloat16, grad=True, mask="bool"), "pieces"),
    ("dual-chunk", call(grad=True, softcap=True), "written-out"),
    ("self-extend", call(), "pieces"),
    ("self-extend", call(grad=True), "written-out"),
    ("self-extend", call(softcap=True), "written-out"),
    ("self-extend", call("cuda", torch.bfloat16), "flex"),
    ("self-extend", call("cuda", torch.bfloat16, grad=True, softcap=True, mask="bool"), "flex"),
    ("self-extend", call("cuda", torch.bfloat16, q_len=1, kv_len=5000), "pieces"),  # decoding: not worth flex
    ("self-extend", call("cuda", torch.bfloat16, base="flash_attention_2"), "flash-attn"),
    ("self-extend", call("cuda", torch.bfloat16, grad=True, base="flash_attention_2"), "flex"),
    ("self-extend", call("cuda", torch.float32, grad=True), "flex"),
]


@pytest.mark.parametrize("scheme,the_call,expected", SELECTION)
def test_the_table_picks_the_first_path_that_takes_the_call(scheme, the_call, expected, monkeypatch):
    monkeypatch.setattr(flex, "_timings", {})
    with flash_attn_present(monkeypatch):
        assert paths.choose(scheme, the_call).name == expected


def test_without_flash_attn_the_flash_paths_step_aside(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else find(name, *a))
    c = call("cuda", torch.bfloat16, base="flash_attention_2")
    assert paths.choose("alibi", c).name == "flex"
    flash = next(p for p in paths.table("alibi") if p.name == "flash-attn")
    assert paths.refusal(flash, c) == "the flash-attn package is not installed"


def test_flash_attn_4_alone_is_not_flash_attn(monkeypatch):
    """flash-attn-4 installs `flash_attn` as a namespace package (flash_attn/cute only): the flash-attn 2 paths must
    not take it for flash-attn and then fail to import flash_attn_func."""
    import importlib.machinery
    import importlib.util

    find = importlib.util.find_spec
    namespace = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)  # origin None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: namespace if name == "flash_attn" else
                        find(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    c = call("cuda", torch.bfloat16, base="flash_attention_2")
    flash = next(p for p in paths.table("alibi") if p.name == "flash-attn")
    assert "flash_attn holds only flash-attn-4's" in paths.refusal(flash, c)
    assert paths.choose("alibi", c).name == "flex"


def test_compiling_needs_a_big_call_until_it_is_compiled(monkeypatch):
    monkeypatch.setattr(flex, "_timings", {})
    big, medium = call(softcap=True), call(softcap=True, q_len=1024, kv_len=1024)
    assert paths.choose("alibi", big).name == "flex"
    assert paths.choose("alibi", medium).name == "written-out"
    monkeypatch.setattr(flex, "_timings", {"first call": 30.0})
    assert paths.choose("alibi", medium).name == "flex"
    assert paths.choose("alibi", call(softcap=True, q_len=1, kv_len=4096)).name == "written-out"


def test_forcing_a_path_that_cannot_take_the_call_says_why():
    model = patched("alibi")
    attn = model.model.layers[0].self_attn
    q, k, v, mask, _ = inputs(10, 10, torch.float32)
    with pytest.raises(ValueError, match="'flash-attn' of position='alibi' cannot take this call: runs on cuda"):
        run_path("alibi", "flash-attn", attn, q, k, v, mask)
    with pytest.raises(ValueError, match="has no attention path 'fast'; it has fa4, flash-attn, factorised, flex"), \
            paths.forcing("alibi", "fast"):
        pass


def test_every_table_ends_with_a_path_that_takes_every_call():
    for scheme in paths.schemes():
        last = paths.table(scheme)[-1]
        assert last.name == "written-out"
        for c in (call(grad=True, dropout=True, softcap=True, mask="float"), call("cuda", torch.float16, grad=True)):
            assert paths.refusal(last, c) in (None, "causal attention only")


# ------------------------------------------------------------------------------------------- low precision models

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme", ["alibi", "t5", "xl", "self-extend", "sinusoidal", "nope", "learned"])
def test_every_scheme_runs_finite_in_low_precision_and_close_to_fp32(scheme, dtype):
    """Logits of the same patched model in bf16/fp16 against fp32, relative to the largest logit: bounded by
    MODEL_TOL (bf16 keeps 8 bits: about 0.4 % per rounding, accumulated over two layers). Inference takes each
    scheme's fast path on the CPU (bf16 and fp16 included)."""
    def build():
        if scheme in SCHEME_KW:
            return patched(scheme)
        size = {"table_size": 160} if scheme == "learned" else {}
        return hfpatch.patch(tiny_model("llama"), position=scheme, **size)

    reference, low = build(), build()
    low.load_state_dict(reference.state_dict())
    low.to(dtype)
    x = tokens(150, batch=2)
    with torch.no_grad():
        want = reference(x).logits
        got = low(x).logits
    assert torch.isfinite(got).all()
    assert max_diff(got.float(), want) <= MODEL_TOL[dtype] * want.abs().max().item()


# -------------------------------------------------------------------------------------------------- compiled

@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["alibi", "t5"])
def test_compiled_flex_equals_the_written_out_path_and_reuses_its_compilation(scheme):
    """The compiled kernel gives the written-out result, and a new length does not compile again: compiled with
    dynamic shapes, one compilation serves every length of one kind of call (here: no mask and square; a padding
    mask and a KV cache). Each compilation takes tens of seconds here."""
    model = patched(scheme, num_buckets=32, max_distance=128) if scheme == "t5" else patched(scheme)
    attn = model.model.layers[0].self_attn
    compiled = []
    for q_len, kv_len, pad in ((300, 300, 0), (421, 421, 0), (64, 500, 30), (90, 700, 41)):
        q, k, v, mask, real = inputs(q_len, kv_len, torch.float32, pad=pad)
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        got = run_path(scheme, "flex", attn, q, k, v, mask, causal=True, softcap=30.0)
        compiled.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)
        want = run_path(scheme, "written-out", attn, q, k, v, mask, causal=True, softcap=30.0)
        assert rel(got, want, real) <= 1e-5
    assert compiled[1] == 0 and compiled[3] == 0, compiled
    assert "first call" in flex.timings()


@CUDA
@pytest.mark.parametrize("scheme,fast", [("alibi", "flex"), ("t5", "flex"), ("self-extend", "flex"),
                                         ("t5", "pieces"), ("self-extend", "pieces")])
def test_cuda_paths_equal_the_written_out_path(scheme, fast):
    model = patched(scheme, torch.bfloat16).cuda()
    attn = model.model.layers[0].self_attn
    for q_len, kv_len, pad in ((300, 300, 0), (300, 300, 40), (50, 400, 40)):
        q, k, v, mask, real = (t.cuda() if t is not None else None for t in inputs(q_len, kv_len, torch.bfloat16,
                                                                                   pad=pad))
        got = run_path(scheme, fast, attn, q, k, v, mask)
        want = run_path(scheme, "written-out", attn, q, k, v, mask)
        assert rel(got, want, real) <= TOL[torch.bfloat16]


@CUDA
@FLASH
@pytest.mark.parametrize("scheme", ["alibi", "self-extend"])
def test_flash_attn_paths_equal_the_written_out_path(scheme):
    model = patched(scheme, torch.bfloat16, attn="flash_attention_2").cuda()
    attn = model.model.layers[0].self_attn
    for q_len, kv_len in ((300, 300), (50, 400)):
        q, k, v, _, real = (t.cuda() if t is not None else None for t in inputs(q_len, kv_len, torch.bfloat16))
        got = run_path(scheme, "flash-attn", attn, q, k, v, None)
        want = run_path(scheme, "written-out", attn, q, k, v, None)
        assert rel(got, want, real) <= TOL[torch.bfloat16]


def test_evaluation_results_say_which_path_ran(tmp_path, monkeypatch):
    from test_eval_perplexity import save_tiny, text_of  # the perplexity tests' tiny model and text

    monkeypatch.setenv("HFPATCH_CACHE", str(tmp_path / "cache"))
    model_dir = save_tiny(tmp_path / "model")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(text_of(130, 1), encoding="utf-8")
    out = tmp_path / "out"
    assert cli_main(["eval", "ppl", "--model", str(model_dir), "--text-files", str(docs), "--lengths", "32",
                     "--tokens-per-doc", "96", "--patches", "none,alibi,t5", "--no-plot", "--out", str(out)]) == 0
    cells = {c["patch"]: c for c in json.loads((out / "results.json").read_text())["cells"]}
    assert "attention_path" not in cells["none"]  # the model's own attention
    assert set(cells["alibi"]["attention_path"]) == {"factorised"}
    assert set(cells["t5"]["attention_path"]) == {"pieces"}
    assert cells["alibi"]["attention_path"]["factorised"] % 2 == 0  # two layers per forward


@pytest.mark.parametrize("error", [TorchDynamoException("a lowering bug"),
                                   FailOnRecompileLimitHit("Hard failure due to fullgraph=True")],
                         ids=["compile-error", "recompile-limit"])
def test_a_flex_compilation_failure_falls_back_to_the_next_path(error, monkeypatch):
    """A failed compilation sends the call to the next path with a warning, never out of the forward. Each kind of
    flex call is one compilation of the one compiled function, and dynamo stops at its recompile_limit (8) with
    FailOnRecompileLimitHit, which is no TorchDynamoException (seen on an H200 running three schemes in one
    process: the ninth kind raised out of the forward); hfpatch's flex calls run with a higher limit."""
    limits = []

    def broken(*args, **kwargs):
        limits.append(torch._dynamo.config.recompile_limit)
        raise error

    monkeypatch.setattr(flex, "compiled_fn", lambda: broken)
    monkeypatch.setattr(flex, "_timings", {})
    monkeypatch.setattr(flex, "_failed", {})
    monkeypatch.setattr(flex, "COMPILE_MIN_SCORES", 1)
    model = patched("alibi")
    attn = model.model.layers[0].self_attn
    q, k, v, _, real = inputs(50, 50, torch.float32)
    paths.reset(model)
    with pytest.warns(RuntimeWarning, match="flex_attention failed to compile"), torch.no_grad():
        got, _ = paths.run("alibi", attn, q, k, v, None, scaling=0.25, dropout=0.0, causal=True,
                           kwargs={"softcap": 20.0})
    assert limits == [flex.RECOMPILE_LIMIT] and torch._dynamo.config.recompile_limit < flex.RECOMPILE_LIMIT
    assert paths.ran(model) == {"written-out": 1}
    assert rel(got, run_path("alibi", "written-out", attn, q, k, v, None, softcap=20.0), real) == 0
    assert f"failed to compile in this process ({type(error).__name__}: {error})" in \
        paths.refusal(next(p for p in paths.table("alibi") if p.name == "flex"), call(softcap=True))


def test_a_row_that_sees_no_key_in_a_kernel_call_gets_output_zero_and_lse_minus_infinity():
    """The piece paths merge kernel calls by log-sum-exp; a padded row may see no key of one piece. What a kernel
    gives such a row differs (CUDA's memory-efficient kernel gave a finite log-sum-exp that the merge weighed: the
    piece paths were 75 % off the written-out path on padded batches on an H200), so `attend` decides it from the
    mask: output 0, log-sum-exp -inf, whatever the kernel said."""
    q, k, v = (torch.randn(2, 4, n, 16, dtype=torch.float64).float() for n in (6, 9, 9))
    visible = torch.ones(2, 1, 6, 9, dtype=torch.bool)
    visible[1, :, :3, :] = False  # rows 0-2 of the second sequence see nothing
    mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    for causal in (False, True):
        out, lse = kernels.attend(q, k, v, 0.25, mask=mask, causal=causal)
        assert (lse[1, :, :3] == float("-inf")).all() and (out[1, :, :3] == 0).all()
        scores = (q.double() @ k.double().transpose(-1, -2)) * 0.25 + mask.double()
        if causal:
            scores = scores.masked_fill(torch.ones(6, 9, dtype=torch.bool).triu(1), float("-inf"))
        want = torch.logsumexp(scores, -1)
        seen = want > -1e30
        assert torch.allclose(lse.double()[seen], want[seen], atol=1e-5)
        assert torch.allclose(out.double()[seen], (torch.softmax(scores, -1) @ v.double())[seen], atol=1e-5)


def test_the_memory_efficient_kernels_bias_is_aligned_whatever_slice_it_comes_from():
    """CUDA's memory-efficient kernel refuses a bias whose start or row stride is not aligned ("attn_bias_ptr is not
    correctly aligned", seen on an H200 with a block of T5's band); a slice of a larger mask is copied into an
    aligned buffer, with the same values."""
    band = torch.randn(1, 4, 40, 77)
    for piece in (band[:, :, 3:35, 5:37], band[:, :, :, 1:], band[..., :32], band[:, :1, :10, 7:20]):
        b, h, q_len, kv_len = 2, 4, piece.shape[2], piece.shape[3]
        bias = kernels._aligned_bias(piece, b, h, q_len, kv_len)
        assert kernels._is_aligned(bias[:1, :1]) and torch.equal(bias, piece.expand(b, h, q_len, kv_len))
    assert not kernels._is_aligned(band[:, :, 3:35, 5:37])


def test_the_implementation_the_model_was_loaded_with_is_remembered():
    """Switching a model to a scheme's attention function replaces config._attn_implementation; the flash-attn paths
    still know it was loaded with flash_attention_2, also when the patched model is patched again."""
    from hfpatch.edits import Edits
    from hfpatch.position.attention.modules import use_attention

    model = tiny_model("llama")
    attn = model.model.layers[0].self_attn
    model.config._attn_implementation_internal = "flash_attention_2"  # as loaded with it (no flash-attn here)
    edits = Edits()
    use_attention(model, "hfpatch_alibi", "hfpatch_alibi_eager", edits)
    assert model.config._attn_implementation == "hfpatch_alibi"
    assert paths.base_of(attn) == "flash_attention_2"
    use_attention(model, "hfpatch_t5", "hfpatch_t5_eager", edits)
    assert paths.base_of(attn) == "flash_attention_2"
    edits.undo()
    assert model.config._attn_implementation == "flash_attention_2"
    assert paths.base_of(patched("alibi").model.layers[0].self_attn) == "sdpa"


def test_merging_parts_by_lse_is_the_softmax_of_their_union_with_finite_gradients():
    """Row 0 sees keys in both parts, row 1 in the second only, row 2 in none (a padded row): the merge weighs each
    part by exp(lse), and no gradient becomes NaN (a padded row's upstream gradient is 0, and 0 * NaN is NaN)."""
    inf = float("inf")
    o1, o2 = torch.randn(1, 1, 3, 4, dtype=torch.float64), torch.randn(1, 1, 3, 4, dtype=torch.float64)
    o1[0, 0, 1:] = 0  # flex/flash give 0 for a row without keys
    o2[0, 0, 2] = 0
    l1 = torch.tensor([[[0.3, -inf, inf]]], dtype=torch.float64)  # +inf: flash-attn's empty row
    l2 = torch.tensor([[[1.1, 0.2, -inf]]], dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (o1, l1, o2, l2)]
    out, _ = kernels.merge_parts([(leaves[0], leaves[1]), (leaves[2], leaves[3])])
    w = torch.softmax(torch.tensor([0.3, 1.1], dtype=torch.float64), 0)
    assert torch.allclose(out[0, 0, 0].double(), w[0] * o1[0, 0, 0] + w[1] * o2[0, 0, 0], atol=1e-6)
    assert torch.allclose(out[0, 0, 1].double(), o2[0, 0, 1], atol=1e-6)
    assert (out[0, 0, 2] == 0).all()
    (out[:, :, :2].sum() + 0 * out[:, :, 2].sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in leaves)


def test_path_counts_start_at_each_position_patch():
    """describe()'s counts are those of the scheme patched now: not its patch's own checks (Self-Extend runs a
    forward), not the calls of a scheme patched before on the same modules."""
    model = hfpatch.patch(tiny_model("llama"), position="self-extend", group_size=2, window=8)
    assert hfpatch.describe(model)["position"]["attention_path"]["ran"] == {}
    x = tokens(40, batch=2)
    with torch.no_grad():
        model(x)
    assert hfpatch.describe(model)["position"]["attention_path"]["ran"] == {"pieces": 2}
    hfpatch.unpatch(model)
    hfpatch.patch(model, position="alibi")
    with torch.no_grad():
        model(x)
    assert hfpatch.describe(model)["position"]["attention_path"]["ran"] == {"factorised": 2}


@pytest.mark.slow
def test_two_self_extend_models_compile_in_one_process_without_breaks_from_hfpatchs_bookkeeping():
    """torch.compile of a second Self-Extend model in one process once failed in dynamo's guard building. The
    bookkeeping the attention function does (the path-count table, the implementation the model was loaded with)
    stays out of the traced graph: no graph break, no recompilation for the second model, and each compiled model
    gives its eager logits."""
    torch._dynamo.reset()
    ids = tokens(3 * WINDOW)
    for seed in (0, 1):
        model = hfpatch.patch(tiny_model("llama", seed=seed), position="self-extend", group_size=4, window=16)
        with torch.no_grad():
            eager = model(ids).logits
            explained = torch._dynamo.explain(model)(ids)
            assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
            compiled = torch.compile(model, backend="eager", fullgraph=True)(ids).logits
        assert torch.equal(compiled, eager)
