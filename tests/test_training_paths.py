"""The training paths that keep no [length, length] tensor for the backward pass: Dual Chunk Attention's and T5's
piece paths (each kernel call's backward given the merged output and log-sum-exp; T5's bias table from the band
alone) and Transformer-XL's recomputed path. Their gradients equal the written-out path's in float64 (which keeps
every block's attention weights and lets autograd differentiate them): a tiny model's every parameter, padded
batches included, and the attention's own inputs with a KV cache, a decoding step and grouped keys; with the CPU's
fused backward and with the torch-ops backward that CUDA runs. What autograd keeps between forward and backward is
measured directly: the written-out path keeps tensors of [heads, length, length], the new paths none larger than the
activations."""

import contextlib

import pytest
import torch
from conftest import tiny_model, tokens

import hfpatch
from hfpatch.position.attention import flex, paths, pieces
from hfpatch.position.schemes import relative

NEW = [("dual-chunk", "pieces", {"chunk_size": 24, "local_window": 4}),
       ("t5", "pieces", {"num_buckets": 8, "max_distance": 20}),
       ("xl", "recomputed", {})]
FLOAT64 = 1e-12  # float64: both sides round at about 1e-16; measured up to 3e-15


def patched(scheme, **options):
    model = hfpatch.patch(tiny_model("llama").double(), position=scheme, **options)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # the scheme's parameters start at zero: give them values
        for name, p in model.named_parameters():
            if "hfpatch" in name:
                p.normal_(0.0, 0.5 if scheme == "t5" else 0.2, generator=g)
    return model.train()


def model_gradients(model, scheme, path, pad):
    """Every parameter's gradient of a loss on 60 tokens x 2 rows, the second left-padded by `pad` with positions
    counting real tokens; predictions made at padded positions are left out of the loss (paths may differ on rows
    that see no key)."""
    ids = tokens(60, batch=2).to(next(model.parameters()).device)
    keep = torch.ones_like(ids)
    keep[1, :pad] = 0
    labels = ids.masked_fill(keep == 0, -100)
    labels[1, :pad + 1] = -100  # the first real token is predicted at a padded position
    given = {"attention_mask": keep, "position_ids": (keep.cumsum(-1) - 1).clamp(min=0)} if pad else {}
    model.zero_grad(set_to_none=True)
    paths.reset(model)
    with paths.forcing(scheme, path):
        model(ids, labels=labels, **given).loss.backward()
    assert paths.ran(model) == {path: 2}
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def worst(got, want):
    assert got.keys() == want.keys()
    return max(((got[n] - want[n]).abs().max() / want[n].abs().max()).item() for n in want)


@pytest.fixture(params=["fused", "torch-ops"])
def backward_kind(request, monkeypatch):
    """The CPU's fused flash-attention backward, or the torch-ops one that CUDA runs."""
    monkeypatch.setattr(pieces, "FUSED_CPU_BACKWARD", request.param == "fused")
    return request.param


@pytest.mark.parametrize("pad", [0, 13])
@pytest.mark.parametrize("scheme,path,options", NEW)
def test_training_gradients_equal_the_written_out_paths(scheme, path, options, pad, backward_kind):
    model = patched(scheme, **options)
    got = model_gradients(model, scheme, path, pad)
    want = model_gradients(model, scheme, "written-out", pad)
    scheme_params = [n for n in want if "hfpatch" in n]
    assert scheme in ("dual-chunk",) or scheme_params  # T5's table and XL's W_R, u, v get their gradients too
    assert worst(got, want) <= FLOAT64


def attention_gradients(scheme, path, module, q_len, kv_len, pad, heads=4, kv_heads=2):
    """(dq, dk, dv) of one attention call (queries the last q_len of kv_len slots, the second row left-padded)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, heads, q_len, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, kv_heads, kv_len, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, kv_heads, kv_len, 16, generator=g, dtype=torch.float64, requires_grad=True)
    slots = torch.arange(kv_len)
    mask = (slots[None, :] <= slots[kv_len - q_len:, None])[None, None].repeat(2, 1, 1, 1)
    mask[1, :, :, :pad] = False
    seen = mask.any(-1)[:, 0]  # [b, q]: rows that see a key
    with paths.forcing(scheme, path):
        out, _ = paths.run(scheme, module, q, k, v, mask if pad or q_len < kv_len else None, scaling=0.25,
                           dropout=0.0, causal=True, kwargs={})
    weights = torch.randn(out.shape, generator=g, dtype=torch.float64) * seen[:, :, None, None]
    (out * weights).sum().backward()
    return q.grad, k.grad, v.grad


@pytest.mark.parametrize("q_len,kv_len,pad", [(50, 50, 7), (20, 70, 0), (20, 70, 9), (1, 70, 9)])
@pytest.mark.parametrize("scheme,path,options", NEW)
def test_attention_gradients_with_a_cache_a_decoding_step_and_grouped_keys(scheme, path, options, q_len, kv_len,
                                                                          pad, backward_kind):
    module = patched(scheme, **options).model.layers[0].self_attn
    got = attention_gradients(scheme, path, module, q_len, kv_len, pad)
    want = attention_gradients(scheme, "written-out", module, q_len, kv_len, pad)
    for a, b in zip(got, want, strict=True):
        assert ((a - b).abs().max() / b.abs().max()).item() <= FLOAT64


LEARNED_IN_SCORE_MOD: list[bool] = []  # per written_flex call: whether its score_mod's bias passes a gradient


def written_flex(query, key, value, scale, score_mod=None, mask=None, *, lse=False, compiled=True):
    """flex.attention's contract with every score written out and differentiated by autograd (torch's flex_attention
    has no backward on the CPU): the score_mod and the block mask's mask_mod applied to broadcast index tensors."""
    b, H, q_len, _ = query.shape
    groups = H // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    kv_len = key.shape[2]
    idx = [torch.arange(n).view(*(1,) * i, n, *(1,) * (3 - i)) for i, n in enumerate((b, H, q_len, kv_len))]
    scores = query @ key.transpose(2, 3) * scale
    if score_mod is not None:
        LEARNED_IN_SCORE_MOD.append(score_mod(torch.zeros((), dtype=scores.dtype), *idx).requires_grad)
        scores = score_mod(scores, *idx)
    if mask is not None:
        scores = scores.masked_fill(~mask.mask_mod(*idx), float("-inf"))
    out = torch.softmax(scores, -1) @ value
    return (out, torch.logsumexp(scores, -1)) if lse else out


def test_t5_flex_training_takes_the_tables_gradient_from_the_band(monkeypatch):
    """CUDA's T5 flex path holds the bias constant in its score_mod (no per-score atomic adds into the table) and
    gets the table's gradient from distance_bias; flex's contract run here by a written-out stand-in."""
    monkeypatch.setattr(flex, "attention", written_flex)
    LEARNED_IN_SCORE_MOD.clear()
    model = patched("t5", num_buckets=8, max_distance=20)
    table = model.base_model.hfpatch_t5_bias.weight
    module = model.model.layers[0].self_attn
    grads = {}
    for name, run in (("flex", relative._t5_flex), ("written-out", paths.table("t5")[-1].run)):
        g = torch.Generator().manual_seed(1)
        q = torch.randn(2, 4, 40, 16, generator=g, dtype=torch.float64, requires_grad=True)
        k = torch.randn(2, 2, 40, 16, generator=g, dtype=torch.float64, requires_grad=True)
        v = torch.randn(2, 2, 40, 16, generator=g, dtype=torch.float64, requires_grad=True)
        table.grad = None
        out = run(module, q, k, v, None, scaling=0.25, dropout=0.0, causal=True, softcap=None, kwargs={})
        (out * torch.randn(out.shape, generator=g, dtype=torch.float64)).sum().backward()
        grads[name] = (q.grad, k.grad, v.grad, table.grad.clone())
    assert LEARNED_IN_SCORE_MOD == [False]  # flex ran, the table a constant in it
    for a, b in zip(*grads.values(), strict=True):
        assert ((a - b).abs().max() / b.abs().max()).item() <= FLOAT64


def largest_saved(model, length, forced=None):
    """The most elements of one tensor autograd keeps for the backward pass of a forward at `length` tokens."""
    sizes = [0]

    def pack(t):
        sizes.append(t.numel())
        return t

    ids = tokens(length, batch=1)
    with (paths.forcing(*forced) if forced else contextlib.nullcontext()), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, labels=ids)
    return max(sizes)


@pytest.mark.parametrize("scheme,path,options", NEW)
def test_no_length_squared_tensor_is_kept_for_the_backward(scheme, path, options):
    """At 320 tokens (4 heads): the written-out path keeps its attention weights (at least heads x L x L elements);
    the new paths keep no tensor larger than the unpatched model's largest (its MLP activations)."""
    model = patched(scheme, **options)
    L = 320
    unpatched = largest_saved(tiny_model("llama").double().train(), L)
    assert largest_saved(model, L, (scheme, "written-out")) >= 4 * L * L > unpatched
    assert largest_saved(model, L, (scheme, path)) <= unpatched


def CUDA(test):
    """A test of the CUDA side of these paths (the pieces' CUDA kernels and torch-ops backward, T5's compiled flex
    with the band gradient): marked `cuda` (pytest -m cuda: eval/gpu_check.sh), skipped here."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return pytest.mark.cuda(skip(test))


@CUDA
@pytest.mark.parametrize("pad", [0, 13])
@pytest.mark.parametrize("scheme,path,options", [*NEW, ("t5", "flex", {"num_buckets": 8, "max_distance": 20})])
def test_training_gradients_equal_the_written_out_paths_on_the_gpu(scheme, path, options, pad):
    """float32 on CUDA (TF32 off): every parameter's gradient within 1e-4 of the written-out path's."""
    model = patched(scheme, **options).float().cuda()
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        got = model_gradients(model, scheme, path, pad)
        want = model_gradients(model, scheme, "written-out", pad)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert worst(got, want) <= 1e-4
