"""ALiBi, NoPE, sinusoidal and interpolated position tables, against references written here: slopes from the
paper's formula and BLOOM's implementation, ALiBi models computed by hand from their weights, the sinusoidal
formula, the interpolation formula."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import FAMILIES, ROPE_FAMILIES, cached_step_and_full, logits, max_diff, tiny_model, tokens
from transformers.models.bloom.modeling_bloom import build_alibi_tensor

import hfpatch
from hfpatch.position.schemes.absolute import sinusoidal_table
from hfpatch.position.schemes.alibi import EAGER_NAME, SDPA_NAME, alibi_slopes, factorise

# ------------------------------------------------------------------------------------------------------------ slopes

def paper_slopes(n):
    """Press et al. 2022: geometric sequence starting at 2^(-8/n) with that ratio (n a power of 2)."""
    start = 2 ** (-8 / n)
    return [start * start**i for i in range(n)]


@pytest.mark.parametrize("n", range(1, 65))
def test_slopes_match_bloom_for_any_head_count(n):
    bloom = build_alibi_tensor(torch.ones(1, 2), n, torch.float64)  # [heads, 1, 2]: slope * key position
    assert alibi_slopes(n) == pytest.approx(bloom[:, 0, 1].tolist(), rel=1e-6)  # BLOOM computes in float32
    if n & (n - 1) == 0:
        assert alibi_slopes(n) == pytest.approx(paper_slopes(n), rel=1e-12)


def test_slopes_examples_from_the_paper():
    assert alibi_slopes(8) == pytest.approx([1 / 2 ** k for k in range(1, 9)])
    assert alibi_slopes(16)[:2] == pytest.approx([2 ** -0.5, 2 ** -1])


# ------------------------------------------------------------------------------------------------ hand references

def rms(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def ln(x, m):
    return F.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)


def naive_alibi_attention(q, k, v, slopes, scale, mask_keep, bidirectional=False):
    """q [b,H,L,d], k/v [b,H,S,d]; mask_keep [b,L,S] bool. Scores + ALiBi written out, fp64."""
    q, k, v = q.double(), k.double(), v.double()
    L, S = q.shape[2], k.shape[2]
    i = torch.arange(S - L, S)[:, None]
    j = torch.arange(S)[None, :]
    dist = (i - j).abs() if bidirectional else (i - j)
    scores = q @ k.transpose(-1, -2) * scale - torch.tensor(slopes, dtype=torch.float64)[:, None, None] * dist
    scores = scores.masked_fill(~mask_keep[:, None], -1e30)  # finite: fully padded rows stay finite (and unused)
    return torch.softmax(scores, -1) @ v


def llama_by_hand(model, ids, keep):
    """A Llama forward written from its weights, with ALiBi instead of RoPE. keep: [b, L] padding mask."""
    cfg, m = model.config, model.model
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // H
    b, L = ids.shape
    x = m.embed_tokens.weight[ids].double()
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    mask = causal[None] & keep[:, None, :].bool()
    slopes = alibi_slopes(H)
    for layer in m.layers:
        a = layer.self_attn
        h = rms(x, layer.input_layernorm.weight.double(), layer.input_layernorm.variance_epsilon)
        q = (h @ a.q_proj.weight.double().T).view(b, L, H, d).transpose(1, 2)
        k = (h @ a.k_proj.weight.double().T).view(b, L, KV, d).transpose(1, 2).repeat_interleave(H // KV, 1)
        v = (h @ a.v_proj.weight.double().T).view(b, L, KV, d).transpose(1, 2).repeat_interleave(H // KV, 1)
        o = naive_alibi_attention(q, k, v, slopes, d ** -0.5, mask).transpose(1, 2).reshape(b, L, H * d)
        x = x + o @ a.o_proj.weight.double().T
        h = rms(x, layer.post_attention_layernorm.weight.double(), layer.post_attention_layernorm.variance_epsilon)
        mlp = layer.mlp
        x = x + (F.silu(h @ mlp.gate_proj.weight.double().T) * (h @ mlp.up_proj.weight.double().T)) \
            @ mlp.down_proj.weight.double().T
    x = rms(x, m.norm.weight.double(), m.norm.variance_epsilon)
    return x @ model.lm_head.weight.double().T


def bert_by_hand(model, ids, keep):
    """BERT's encoder from its weights: no position embeddings, bidirectional ALiBi, post-norm."""
    cfg, m = model.config, model.bert
    H = cfg.num_attention_heads
    d = cfg.hidden_size // H
    b, L = ids.shape
    e = m.embeddings
    x = e.word_embeddings.weight[ids] + e.token_type_embeddings.weight[0]
    x = ln(x, e.LayerNorm).double()
    mask = keep[:, None, :].bool().expand(b, L, L)
    slopes = alibi_slopes(H)
    for layer in m.encoder.layer:
        s = layer.attention.self
        lin = lambda t, mod: t @ mod.weight.double().T + mod.bias.double()
        q, k, v = (lin(x, p).view(b, L, H, d).transpose(1, 2) for p in (s.query, s.key, s.value))
        o = naive_alibi_attention(q, k, v, slopes, d ** -0.5, mask, bidirectional=True)
        o = o.transpose(1, 2).reshape(b, L, H * d)
        x = ln((lin(o, layer.attention.output.dense) + x).float(), layer.attention.output.LayerNorm).double()
        f = F.gelu(lin(x, layer.intermediate.dense))
        x = ln((lin(f, layer.output.dense) + x).float(), layer.output.LayerNorm).double()
    return x


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_llama_alibi_equals_the_hand_computation(padding, attn):
    """GQA (4 heads, 2 KV heads), batch 2, padding on either side, both attention implementations."""
    model = tiny_model("llama", attn_implementation=attn)
    ids = tokens(40, batch=2)
    keep = torch.ones(2, 40, dtype=torch.long)
    if padding == "left":
        keep[1, :13] = 0
    elif padding == "right":
        keep[1, -13:] = 0
    hfpatch.patch(model, position="alibi")
    assert model.config._attn_implementation == (EAGER_NAME if attn == "eager" else SDPA_NAME)
    with torch.no_grad():
        out = model(ids, attention_mask=keep).logits
    expected = llama_by_hand(model, ids, keep)
    real = keep.bool()
    assert max_diff(out[real].double(), expected[real]) <= 1e-4


def test_padding_does_not_change_the_real_tokens():
    """ALiBi depends on i - j only: a left-padded sequence scores its real tokens as the same sequence alone."""
    model = hfpatch.patch(tiny_model("llama"), position="alibi")
    ids = tokens(30)
    alone = logits(model, ids)
    padded = torch.cat([torch.zeros(1, 9, dtype=torch.long), ids], 1)
    keep = torch.cat([torch.zeros(1, 9, dtype=torch.long), torch.ones(1, 30, dtype=torch.long)], 1)
    with torch.no_grad():
        out = model(padded, attention_mask=keep).logits[:, 9:]
    assert max_diff(out, alone) <= 1e-5


@pytest.mark.parametrize("padding", [False, True])
def test_bert_bidirectional_alibi_equals_the_hand_computation(padding):
    model = tiny_model("bert")
    ids = tokens(30, batch=2)
    keep = torch.ones(2, 30, dtype=torch.long)
    if padding:
        keep[0, -7:] = 0
    hfpatch.patch(model, position="alibi")
    with torch.no_grad():
        out = model.bert(ids, attention_mask=keep).last_hidden_state
    expected = bert_by_hand(model, ids, keep)
    assert max_diff(out[keep.bool()].double(), expected[keep.bool()]) <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_fast_and_explicit_paths_agree(family):
    """On every family the factorised sdpa path equals the explicit scores-plus-bias path (forced through the
    eager attention name), including gemma2's softcapping and the sliding windows of mistral/gemma2/gemma3."""
    x = tokens(50, batch=2)
    fast = hfpatch.patch(tiny_model(family), position="alibi")
    slow = tiny_model(family, attn_implementation="eager")
    hfpatch.patch(slow, position="alibi")
    assert slow.config._attn_implementation == EAGER_NAME
    assert max_diff(logits(fast, x), logits(slow, x)) <= 2e-5


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "bert"])
def test_kv_cache_decode_equals_full_forward(family):
    model = hfpatch.patch(tiny_model(family), position="alibi")
    x = tokens(60)
    step, full = cached_step_and_full(model, x)
    assert max_diff(step, full) <= 1e-5
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(model.generate(x, use_cache=True, **kw), model.generate(x, use_cache=False, **kw))


def test_training_gradients_flow_and_match_the_explicit_path():
    grads = {}
    for attn in ("sdpa", "eager"):
        model = hfpatch.patch(tiny_model("llama", attn_implementation=attn), position="alibi").train()
        x = tokens(32, batch=2)
        model(x, labels=x).loss.backward()
        grads[attn] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads["sdpa"].keys() == grads["eager"].keys()
    for n in grads["sdpa"]:
        assert torch.isfinite(grads["sdpa"][n]).all()
        assert torch.allclose(grads["sdpa"][n], grads["eager"][n], atol=1e-5), n
    assert grads["sdpa"]["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_factorisation_is_exact_in_low_precision(dtype, tol):
    """The key position is split as 256*hi + lo so both channels are exact in bf16; the bias the dot product
    adds equals m * (j - c) up to the rounding of the slope to the dtype."""
    torch.manual_seed(0)
    H, d, L = 4, 8, 3000
    q, k, v = (torch.zeros(1, H, L, d, dtype=dtype) for _ in range(3))
    slopes = torch.tensor(alibi_slopes(H))
    qa, ka, _ = factorise(slopes, q, k, v, scaling=0.125, centre=1500)
    added = (qa.float() @ ka.float().transpose(-1, -2))[0, :, 0] * 0.125  # [H, L]
    m = (slopes / 0.125).to(dtype).float() * 0.125
    expected = m[:, None] * (torch.arange(L) - 1500).float()[None]
    assert (added - expected).abs().max() <= tol * expected.abs().max()


def test_denormal_flushing_is_scoped():
    """The ALiBi call flushes denormals and restores the previous mode, whichever it was."""
    from hfpatch.position.schemes.alibi import _flushing, no_denormals

    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU cannot flush denormals")
    with no_denormals(torch.device("cpu")):
        assert _flushing()
    assert not _flushing()
    torch.set_flush_denormal(True)
    try:
        with no_denormals(torch.device("cpu")):
            assert _flushing()
        assert _flushing()
    finally:
        torch.set_flush_denormal(False)


# -------------------------------------------------------------------------------------------------------- no position

ONE_LAYER = {"gpt2": {"n_layer": 1}, "gemma3_text": {"num_hidden_layers": 1, "layer_types": ["full_attention"]}}


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "bert"])
def test_nope_makes_the_prefix_order_invisible(family):
    """Without any position signal, a one-block causal model sees its prefix as a set: permuting the tokens before
    the last one leaves the last token's logits unchanged (with the original encoding it does not). One block,
    because causal masking itself leaks order to the next block."""
    model = tiny_model(family, **ONE_LAYER.get(family, {"num_hidden_layers": 1}))
    x = tokens(12)
    perm = torch.cat([torch.randperm(11, generator=torch.Generator().manual_seed(3)), torch.tensor([11])])
    assert max_diff(logits(model, x)[:, -1], logits(model, x[:, perm])[:, -1]) > 1e-4
    hfpatch.patch(model, position="nope")
    assert max_diff(logits(model, x)[:, -1], logits(model, x[:, perm])[:, -1]) <= 1e-5


def test_nope_on_bert_is_permutation_equivariant():
    model = hfpatch.patch(tiny_model("bert"), position="nope")
    x = tokens(20)
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(4))
    assert max_diff(logits(model, x)[:, perm], logits(model, x[:, perm])) <= 1e-5


# ------------------------------------------------------------------------------------------------------- sinusoidal

def test_sinusoidal_table_formula():
    pe = sinusoidal_table(torch.tensor([1]), 4)[0]
    assert pe.tolist() == pytest.approx([math.sin(1), math.cos(1), math.sin(1 / 100), math.cos(1 / 100)])
    assert pe.tolist() == pytest.approx([0.841, 0.540, 0.010, 0.999], abs=1e-3)  # the example
    pos, dim = torch.arange(50), 64
    table = sinusoidal_table(pos, dim)
    for p in (0, 7, 49):
        for i in range(dim // 2):
            assert table[p, 2 * i].item() == pytest.approx(math.sin(p / 10000 ** (2 * i / dim)), abs=1e-6)
            assert table[p, 2 * i + 1].item() == pytest.approx(math.cos(p / 10000 ** (2 * i / dim)), abs=1e-6)


@pytest.mark.parametrize("pe_scale", [None, 0.03])
@pytest.mark.parametrize("family", ["gpt2", "opt", "bert"])
def test_sinusoidal_replaces_a_learned_table(family, pe_scale):
    kwargs = {} if pe_scale is None else {"pe_scale": pe_scale}
    model = hfpatch.patch(tiny_model(family), position="sinusoidal", **kwargs)
    adapter = hfpatch.adapters.adapter_for(model)
    table = hfpatch.adapters.get_path(model.base_model, adapter.position_table)
    seen = {}
    table.register_forward_hook(lambda m, a, out: seen.setdefault("out", out))
    logits(model, tokens(12))
    d = model.config.hidden_size
    assert max_diff(seen["out"][0], sinusoidal_table(torch.arange(12), d) * (pe_scale or 1.0)) <= 1e-6


@pytest.mark.parametrize("pe_scale", [None, 0.03])
@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_sinusoidal_on_a_rope_model_adds_the_table_to_the_input(family, pe_scale):
    """sinusoidal(ids) equals the same model without any position signal (nope) fed embeddings + pe_scale * PE."""
    x = tokens(30)
    kwargs = {} if pe_scale is None else {"pe_scale": pe_scale}
    sin_model = hfpatch.patch(tiny_model(family), position="sinusoidal", **kwargs)
    nope = hfpatch.patch(tiny_model(family), position="nope")
    rotary = sin_model.base_model.rotary_emb
    assert all(torch.count_nonzero(t) == 0 for n, t in rotary.named_buffers() if n.endswith("inv_freq"))
    with torch.no_grad():
        pe = sinusoidal_table(torch.arange(30), nope.config.hidden_size) * (pe_scale or 1.0)
        expected = nope(inputs_embeds=nope.get_input_embeddings()(x) + pe).logits
    assert max_diff(logits(sin_model, x), expected) <= 1e-5


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_sinusoidal_pe_scale_survives_save_reload_and_unpatches_exactly(tmp_path, family):
    fresh, model = tiny_model(family), tiny_model(family)
    x = tokens(24)
    hfpatch.patch(model, position="sinusoidal", pe_scale=0.05)
    scaled = logits(model, x)
    assert max_diff(scaled, logits(hfpatch.patch(tiny_model(family), position="sinusoidal"), x)) > 1e-3
    hfpatch.save_pretrained(model, tmp_path)
    assert max_diff(logits(hfpatch.from_pretrained(tmp_path), x), scaled) == 0.0
    hfpatch.unpatch(model)
    assert max_diff(logits(model, x), logits(fresh, x)) == 0.0


@pytest.mark.parametrize("value", [0, -1, "big"])
def test_sinusoidal_bad_pe_scale_is_refused_and_model_untouched(value):
    model, fresh = tiny_model("llama"), tiny_model("llama")
    with pytest.raises((ValueError, TypeError), match="pe_scale"):
        hfpatch.patch(model, position="sinusoidal", pe_scale=value)
    assert max_diff(logits(model, tokens(16)), logits(fresh, tokens(16))) == 0.0


def test_pe_scale_is_refused_on_other_schemes():
    with pytest.raises(ValueError, match="pe_scale"):
        hfpatch.patch(tiny_model("llama"), position="nope", pe_scale=0.1)


# ------------------------------------------------------------------------------------------------------ interpolate

def naive_interpolation(table, s):
    n = table.shape[0]
    rows = []
    for p in range(math.ceil(n * s)):
        x = min(p / s, n - 1)
        lo = math.floor(x)
        hi = min(lo + 1, n - 1)
        w = x - lo
        rows.append((1 - w) * table[lo] + w * table[hi])
    return torch.stack(rows)


@pytest.mark.parametrize("family", ["gpt2", "opt", "bert"])
def test_interpolate_stretches_the_table(family, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    model = tiny_model(family)
    adapter = hfpatch.adapters.adapter_for(model)
    table = hfpatch.adapters.get_path(model.base_model, adapter.position_table)
    old = table.weight.detach().clone()
    hfpatch.patch(model, position="interpolate", factor=2.5)
    new = hfpatch.adapters.get_path(model.base_model, adapter.position_table).weight
    off = adapter.position_offset
    assert torch.equal(new[:off], old[:off])
    assert max_diff(new[off:], naive_interpolation(old[off:], 2.5)) <= 1e-6
    assert model.config.max_position_embeddings == math.ceil(64 * 2.5)
    x = tokens(150)  # longer than the original 64 positions
    out = logits(model, x)
    assert out.shape[1] == 150 and torch.isfinite(out).all()
    hfpatch.save_pretrained(model, tmp_path)
    plain = (AutoModelForMaskedLM if family == "bert" else AutoModelForCausalLM).from_pretrained(tmp_path).eval()
    assert max_diff(logits(plain, x), out) == 0.0  # a bigger table is a plain checkpoint
    assert max_diff(logits(hfpatch.from_pretrained(tmp_path), x), out) == 0.0
    hfpatch.unpatch(model)
    assert torch.equal(hfpatch.adapters.get_path(model.base_model, adapter.position_table).weight, old)


# ------------------------------------------------------------------------------------------------------ composition

def test_alibi_composes_with_a_norm_swap_and_unpatches(tmp_path):
    model = tiny_model("gpt2")
    x = tokens(40)
    before = logits(model, x)
    hfpatch.patch(model, position="alibi", norm="rmsnorm")
    out = logits(model, x)
    hfpatch.save_pretrained(model, tmp_path)
    assert max_diff(logits(hfpatch.from_pretrained(tmp_path), x), out) == 0.0
    hfpatch.unpatch(model)
    assert model.config._attn_implementation == "sdpa"
    assert max_diff(logits(model, x), before) == 0.0
