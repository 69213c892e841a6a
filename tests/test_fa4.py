"""The FlashAttention-4 paths (flash-attn-4, `flash_attn.cute`): which calls they take and why they step aside, checked
here with the device and the package mocked through the same functions the path picker calls (fa4.package_present,
fa4.capability, torch.cuda.is_available); each scheme's FA4 runner (layouts, the bias table handed to the kernel,
the merges, the gradients) run against the written-out path with FA4 itself replaced by the same arithmetic in torch;
and, on a GPU with the package, FA4 itself against the written-out path (marked `cuda`, skipped here)."""

import math
import warnings

import pytest
import torch
from conftest import tiny_model, tokens

import hfpatch
from hfpatch.position.attention import fa4, paths
from hfpatch.position.schemes import alibi, dual_chunk, relative, self_extend

OPTIONS = {"alibi": {}, "t5": {"num_buckets": 8, "max_distance": 20},
           "dual-chunk": {"chunk_size": 24, "local_window": 4}, "self-extend": {"group_size": 3, "window": 16}}
RUNNERS = {"alibi": alibi._fa4, "t5": relative._t5_fa4, "dual-chunk": dual_chunk._run_fa4,
           "self-extend": self_extend._run_fa4}
SCHEMES = list(RUNNERS)


def call(device="cuda", dtype=torch.bfloat16, grad=False, softcap=False, causal=True, mask="none", q_len=4096,
         kv_len=4096):
    return paths.Call(device, dtype, grad, False, softcap, causal, mask, q_len, kv_len, "sdpa")


@pytest.fixture
def machine(monkeypatch):
    """A CUDA machine with flash-attn-4, of a compute capability the test sets (default 9.0, an H100/H200)."""
    state = {"capability": (9, 0), "package": True}
    monkeypatch.setattr(fa4, "package_present", lambda: state["package"])
    monkeypatch.setattr(fa4, "capability", lambda: state["capability"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fa4, "_failed", {})
    return state


SELECTION = [
    ("alibi", call(), "fa4"),
    ("alibi", call(grad=True), "fa4"),
    ("alibi", call(mask="bool", q_len=1), "fa4"),  # a KV-cached call's causal mask (padding: the runner says no)
    ("alibi", call(softcap=True), "flex"),  # FA4 takes no softcapping beside a score_mod
    ("alibi", call(causal=False), "flex"),
    ("alibi", call(dtype=torch.float32), "flex"),
    ("t5", call(), "fa4"),
    ("t5", call(grad=True), "fa4"),  # the table's gradient from distance_bias
    ("t5", call(causal=False), "flex"),
    ("dual-chunk", call(), "fa4"),
    ("dual-chunk", call(grad=True, softcap=True), "fa4"),  # no score_mod: FA4's own softcapping
    ("dual-chunk", call(dtype=torch.float32, grad=True), "pieces"),
    ("self-extend", call(), "fa4"),
    ("self-extend", call(grad=True, softcap=True, mask="bool"), "fa4"),
    ("self-extend", call(dtype=torch.float32, grad=True), "flex"),
    ("xl", call(grad=True), "recomputed"),  # no FA4 form: its position term is no score_mod
]


@pytest.mark.parametrize("scheme,the_call,expected", SELECTION)
def test_on_hopper_with_the_package_the_picker_prefers_fa4(scheme, the_call, expected, machine):
    assert paths.choose(scheme, the_call).name == expected


@pytest.mark.parametrize("capability,package,cuda,why", [
    ((8, 0), True, True, "need compute capability 9.x-11.x (Hopper, Blackwell); this device has 8.0"),
    ((12, 0), True, True, "this device has 12.0"),
    ((9, 0), False, True, "the flash-attn-4 package (flash_attn.cute) is not installed"),
    ((9, 0), True, False, "FlashAttention-4 needs a CUDA device"),
])
def test_elsewhere_the_table_falls_back_and_describe_says_why(capability, package, cuda, why, machine, monkeypatch):
    machine.update(capability=capability, package=package)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    for scheme, fallback in (("alibi", "flex"), ("t5", "flex"), ("dual-chunk", "pieces"), ("self-extend", "flex")):
        assert paths.choose(scheme, call()).name == fallback
        fa4_path = paths.table(scheme)[0]
        assert fa4_path.name == "fa4" and why in paths.refusal(fa4_path, call())
        model = hfpatch.patch(tiny_model("llama"), position=scheme, **OPTIONS[scheme])
        assert why in hfpatch.describe(model)["position"]["attention_path"]["unavailable"]["fa4"]


def test_the_package_check_is_an_import_check_of_flash_attn_cute():
    """On this machine (no flash-attn-4) the real check says it is missing, and describe() says so."""
    assert not fa4.package_present()
    model = hfpatch.patch(tiny_model("llama"), position="alibi")
    info = hfpatch.describe(model)["position"]["attention_path"]
    assert info["order"][0] == "fa4"
    assert info["unavailable"]["fa4"] in ("the flash-attn-4 package (flash_attn.cute) is not installed",
                                          "FlashAttention-4 needs a CUDA device")


def test_describe_says_why_the_paths_before_the_one_that_ran_did_not_take_the_call():
    model = hfpatch.patch(tiny_model("llama"), position="t5", **OPTIONS["t5"])
    x = tokens(40, batch=2)
    with torch.no_grad():
        model(x)
    passed = hfpatch.describe(model)["position"]["attention_path"]["passed_over"]
    assert passed["fa4"] == "runs on cuda, not cpu" and passed["flex"] == "runs on cuda, not cpu"
    assert hfpatch.describe(model)["position"]["attention_path"]["ran"] == {"pieces": 2}


def test_only_plain_causal_calls_pass_the_padding_check():
    q_len, kv_len = 3, 7
    slots = torch.arange(kv_len)
    causal = (slots[None, :] <= slots[kv_len - q_len:, None])[None, None].repeat(2, 1, 1, 1)
    fa4.require_plain_causal(None, q_len, kv_len)
    fa4.require_plain_causal(causal, q_len, kv_len)
    padded = causal.clone()
    padded[1, :, :, :2] = False
    for mask in (padded, torch.zeros(2, 1, q_len, kv_len)):
        with pytest.raises(paths.PathUnavailable, match="a padding mask"):
            fa4.require_plain_causal(mask, q_len, kv_len)


# ------------------------------------------------------------------------------------ the runners, FA4 in torch

def torch_attend(q, k, v, scale, *, causal, window=(None, None), score_mod=None, score_mod_bwd=None, aux=None,
                 softcap=None):
    """fa4.attend's contract in torch ops (bottom-right causal and window, the score_mods by the factory that made
    them)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    q_len, kv_len = q.shape[2], k.shape[2]
    scores = q @ k.transpose(2, 3) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    distance = torch.arange(q_len)[:, None] + (kv_len - q_len) - torch.arange(kv_len)[None, :]
    if score_mod == "alibi":
        scores = scores - aux[0][None, :, None, None] * distance
    elif isinstance(score_mod, tuple):  # ("near_far", D)
        D = score_mod[1]
        table = aux[0].view(q.shape[1], D + 1).to(scores.dtype)
        scores = scores + table[:, distance.clamp(0, D)][None]
    seen = torch.ones_like(distance, dtype=torch.bool)
    if causal:
        seen &= distance >= 0
    if window[0] is not None:
        seen &= distance <= window[0]
    # a row that sees no key: output 0 and log-sum-exp -inf, finite gradients (FA4's kernels do the same)
    some = seen.any(-1, keepdim=True)
    scores = torch.where(some, scores.masked_fill(~seen, float("-inf")), 0.0)
    weights = torch.softmax(scores, -1).masked_fill(~seen, 0.0)
    return weights @ v, torch.logsumexp(scores, -1).masked_fill(~some[..., 0], float("-inf"))


@pytest.fixture
def fa4_in_torch(monkeypatch):
    monkeypatch.setattr(fa4, "attend", torch_attend)
    monkeypatch.setattr(fa4, "alibi_mod", lambda: "alibi")
    monkeypatch.setattr(fa4, "near_far_mod", lambda D: ("near_far", D))
    monkeypatch.setattr(fa4, "additive_bwd", lambda: "pass-through")


def patched(scheme):
    model = hfpatch.patch(tiny_model("llama").double(), position=scheme, **OPTIONS[scheme])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "hfpatch" in name:
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(3))
    return model


def one_call(run, module, q_len, kv_len, mask):
    """Output and (dq, dk, dv, d scheme parameters) of one attention call through `run`."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, q_len, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, kv_len, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, kv_len, 16, generator=g, dtype=torch.float64, requires_grad=True)
    params = [module.hfpatch_t5.table.weight] if hasattr(module, "hfpatch_t5") else []  # T5's table
    for p in params:
        p.grad = None
    out = run(module, q, k, v, mask, scaling=0.25, dropout=0.0, causal=True, softcap=None, kwargs={})
    (out * torch.randn(out.shape, generator=g, dtype=torch.float64)).sum().backward()
    return out, [q.grad, k.grad, v.grad, *(p.grad for p in params)]


@pytest.mark.parametrize("q_len,kv_len", [(60, 60), (20, 70), (1, 70)])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_runner_equals_the_written_out_path_with_fa4_in_torch(scheme, q_len, kv_len, fa4_in_torch):
    """The runner's own work around the kernel (transposes, ALiBi's slopes and T5's table as aux tensors in the
    layout the score_mods read, Dual Chunk Attention's merges, T5's table gradient from distance_bias), with FA4
    replaced by its contract in torch: outputs and gradients equal the written-out path's (float64), a KV cache and
    a decoding step included."""
    module = patched(scheme).model.layers[0].self_attn
    slots = torch.arange(kv_len)
    mask = None if q_len in (1, kv_len) else (slots[None, :] <= slots[kv_len - q_len:, None])[None, None].repeat(
        2, 1, 1, 1)
    got, got_grads = one_call(RUNNERS[scheme], module, q_len, kv_len, mask)
    want, want_grads = one_call(paths.table(scheme)[-1].run, module, q_len, kv_len, mask)
    tol = 1e-6 if scheme == "t5" else 1e-12  # T5's table reaches the kernel in float32, as its score_mod reads it
    assert (got - want).abs().max() <= tol * want.abs().max()
    assert len(got_grads) == len(want_grads) >= 3
    for a, b in zip(got_grads, want_grads, strict=True):
        assert (a - b).abs().max() <= tol * b.abs().max()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_padded_call_makes_the_fa4_runners_step_aside(scheme, fa4_in_torch):
    """FA4 takes no padding mask: the runner raises paths.PathUnavailable, and the call goes to the next path."""
    module = patched(scheme).model.layers[0].self_attn
    q = torch.randn(2, 4, 30, 16, dtype=torch.float64)
    k = v = torch.randn(2, 2, 30, 16, dtype=torch.float64)
    slots = torch.arange(30)
    mask = (slots[None, :] <= slots[:, None])[None, None].repeat(2, 1, 1, 1)
    mask[1, :, :, :5] = False
    with pytest.raises(paths.PathUnavailable, match="a padding mask"):
        RUNNERS[scheme](module, q, k, v, mask, scaling=0.25, dropout=0.0, causal=True, softcap=None, kwargs={})


def test_a_failing_fa4_warns_once_and_steps_aside_for_the_process(machine, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("DSL compile error: unsupported op")

    import sys
    import types

    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func = broken
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    q = torch.randn(1, 4, 8, 16)
    with pytest.warns(RuntimeWarning, match="FlashAttention-4 failed"), pytest.raises(paths.PathUnavailable):
        fa4.attend(q, q[:, :2], q[:, :2], 0.25, causal=True)
    assert "failed in this process (RuntimeError: DSL compile error" in paths.refusal(paths.table("alibi")[0], call())
    assert paths.choose("alibi", call()).name == "flex"


# ------------------------------------------------------------------------------------------------ on a GPU

def CUDA_FA4(test):
    """FA4 itself: needs a CUDA device of compute capability 9.x-11.x and flash-attn-4 (pytest -m cuda:
    eval/gpu_check.sh)."""
    why = fa4.missing() if torch.cuda.is_available() else "needs a CUDA device"
    return pytest.mark.cuda(pytest.mark.skipif(why is not None, reason=f"FlashAttention-4: {why}")(test))


BF16 = 3e-2  # test_attention_paths.TOL[torch.bfloat16]: both sides round to 8 bits in different places


def cuda_model(scheme):
    model = hfpatch.patch(tiny_model("llama"), position=scheme, **OPTIONS[scheme])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "hfpatch" in name:
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(3))
    return model.to("cuda", torch.bfloat16)


def cuda_inputs(q_len, kv_len, pad=0, heads=4, kv_heads=2, d=16, grad=False):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, h, n, d, generator=g, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
               for h, n in ((heads, q_len), (kv_heads, kv_len), (kv_heads, kv_len)))
    slots = torch.arange(kv_len, device="cuda")
    mask = (slots[None, :] <= slots[kv_len - q_len:, None])[None, None].repeat(2, 1, 1, 1)
    mask[1, :, :, :pad] = False
    return q, k, v, (mask if pad or q_len < kv_len else None), mask.any(-1)[:, 0]


def relative_error(a, b, rows):
    a, b = a.float()[rows], b.float()[rows]
    return ((a - b).abs().max() / b.abs().max()).item()


@CUDA_FA4
@pytest.mark.parametrize("scheme", SCHEMES)
def test_fa4_equals_the_written_out_path_on_the_gpu(scheme):
    """Prefill, a KV-cached chunk, a decoding step (the path taken, not forced), and a padded batch (FA4 steps
    aside: the call takes the next path, and still equals)."""
    model = cuda_model(scheme)
    module = model.model.layers[0].self_attn
    for q_len, kv_len, pad in ((300, 300, 0), (50, 400, 0), (1, 400, 0), (300, 300, 40)):
        q, k, v, mask, real = cuda_inputs(q_len, kv_len, pad)
        paths.reset(model)
        with torch.no_grad():
            got, _ = paths.run(scheme, module, q, k, v, mask, scaling=0.25, dropout=0.0, causal=True, kwargs={})
            ran = paths.ran(model)
            with paths.forcing(scheme, "written-out"):
                want, _ = paths.run(scheme, module, q, k, v, mask, scaling=0.25, dropout=0.0, causal=True,
                                    kwargs={})
        assert (ran == {"fa4": 1}) == (pad == 0), (q_len, kv_len, pad, ran)
        assert relative_error(got, want, real) <= BF16, (q_len, kv_len, pad)


@CUDA_FA4
@pytest.mark.parametrize("scheme", SCHEMES)
def test_fa4_gradients_are_close_to_the_written_out_paths_on_the_gpu(scheme):
    """Training through FA4 (T5's table by distance_bias): gradients of q, k, v and the scheme's parameters within
    bf16's reach of the written-out path's (relative to each one's largest entry)."""
    model = cuda_model(scheme)
    module = model.model.layers[0].self_attn
    grads = {}
    for path in ("fa4", "written-out"):
        q, k, v, _, _ = cuda_inputs(256, 256, grad=True)
        model.zero_grad(set_to_none=True)
        with paths.forcing(scheme, path):
            out, _ = paths.run(scheme, module, q, k, v, None, scaling=0.25, dropout=0.0, causal=True, kwargs={})
        weights = torch.randn(out.shape, generator=torch.Generator(device="cuda").manual_seed(5), device="cuda",
                              dtype=out.dtype)
        (out.float() * weights.float()).sum().backward()
        grads[path] = [q.grad, k.grad, v.grad, *(p.grad for n, p in model.named_parameters() if "hfpatch" in n)]
    for a, b in zip(grads["fa4"], grads["written-out"], strict=True):
        assert (a.float() - b.float()).abs().max() <= 5e-2 * b.float().abs().max()


@CUDA_FA4
def test_a_model_trains_and_generates_through_fa4_on_the_gpu():
    """A tiny model's training step and a cached greedy generation run on FA4 (decoding included) and give what the
    written-out path gives."""
    for scheme in SCHEMES:
        model = cuda_model(scheme)
        ids = tokens(200, batch=2).cuda()
        paths.reset(model)
        model(ids, labels=ids).loss.backward()
        assert set(paths.ran(model)) == {"fa4"}, (scheme, paths.ran(model))
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fast = model.generate(ids[:, :100], max_new_tokens=8, do_sample=False, pad_token_id=0)
            with paths.forcing(scheme, "written-out"):
                slow = model.generate(ids[:, :100], max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert (fast == slow).float().mean() >= 0.9, scheme  # bf16: a near tie may flip a token
        assert math.isfinite(float(model(ids, labels=ids).loss))
