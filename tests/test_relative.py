"""position="t5" / "xl" / "learned", against references written here: transformers' own T5 bucketing, a Llama
forward written by hand in float64 with T5's bias or Transformer-XL's four terms; the learned table's limit; and
every new scheme (and norm="batchnorm") through unpatch / save / reload on several families."""

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_fingerprint, fingerprint, logits, max_diff, tiny_model, tokens
from transformers.models.t5.modeling_t5 import T5Attention

import hfpatch
import hfpatch.introspect
from hfpatch.position.attention import written as attention
from hfpatch.position.schemes.learned import TABLE_ATTR
from hfpatch.position.schemes.relative import T5_TABLE, XL_ATTR, XLPositions, t5_buckets


def randomize_new_parameters(model, seed=0):
    """The new parameters start at zero (t5, xl) or small: give them values that matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "hfpatch" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))


# ------------------------------------------------------------------------------------------------------ T5 buckets

@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 20), (64, 1000), (5, 7)])
def test_t5_buckets_equal_transformers(bidirectional, num_buckets, max_distance):
    rel = torch.arange(-3000, 3001)
    ours = t5_buckets(rel, bidirectional, num_buckets, max_distance)
    ref = T5Attention._relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
    assert torch.equal(ours, ref)


# ------------------------------------------------------------------------------------------- hand-written models

def rms(x, norm):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight.double()


def llama_by_hand(model, ids, keep, scores_of):
    """A Llama forward from its weights in float64, without RoPE; scores_of(layer, q, k) gives the scaled scores
    [b, H, L, L] (position terms included) before masking."""
    cfg, m = model.config, model.model
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // H
    b, L = ids.shape
    x = m.embed_tokens.weight[ids].double()
    mask = torch.tril(torch.ones(L, L, dtype=torch.bool))[None] & keep[:, None, :].bool()
    for layer in m.layers:
        a = layer.self_attn
        h = rms(x, layer.input_layernorm)
        q = (h @ a.q_proj.weight.double().T).view(b, L, H, d).transpose(1, 2)
        k = (h @ a.k_proj.weight.double().T).view(b, L, KV, d).transpose(1, 2).repeat_interleave(H // KV, 1)
        v = (h @ a.v_proj.weight.double().T).view(b, L, KV, d).transpose(1, 2).repeat_interleave(H // KV, 1)
        s = scores_of(layer, q, k).masked_fill(~mask[:, None], -1e30)
        o = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(b, L, H * d)
        x = x + o @ a.o_proj.weight.double().T
        h = rms(x, layer.post_attention_layernorm)
        mlp = layer.mlp
        x = x + (F.silu(h @ mlp.gate_proj.weight.double().T) * (h @ mlp.up_proj.weight.double().T)) \
            @ mlp.down_proj.weight.double().T
    return rms(x, m.norm) @ model.lm_head.weight.double().T


def t5_scores(model, bidirectional=False, num_buckets=32, max_distance=128):
    table = getattr(model.model, T5_TABLE).weight.double()  # [buckets, heads], shared by the layers

    def scores(layer, q, k):
        L, d = q.shape[2], q.shape[-1]
        pos = torch.arange(L)
        buckets = T5Attention._relative_position_bucket(pos[None, :] - pos[:, None], bidirectional, num_buckets,
                                                        max_distance)
        return q @ k.transpose(-1, -2) * d ** -0.5 + table[buckets].permute(2, 0, 1)[None]
    return scores


def sinusoid(distance: float, width: int) -> torch.Tensor:
    """R_distance: sin(distance / 10000^(2i/width)) at 2i, cos at 2i + 1."""
    i = torch.arange(0, width, 2, dtype=torch.float64)
    angle = distance / 10000.0 ** (i / width)
    out = torch.empty(width, dtype=torch.float64)
    out[0::2], out[1::2] = torch.sin(angle), torch.cos(angle)
    return out


def xl_four_terms(xl: XLPositions, q, k, q_pos, k_pos, scale):
    """Transformer-XL's score, term by term, in float64: q·k + q·W_R R_{i-j} + u·k + v·W_R R_{i-j}."""
    heads, d = xl.u.shape
    W, u, v = xl.r_net.weight.double(), xl.u.double(), xl.v.double()
    q, k = q.double(), k.double()
    R = torch.stack([torch.stack([sinusoid(float(i - j), xl.d_model) for j in k_pos]) for i in q_pos])
    WR = (R @ W.T).view(len(q_pos), len(k_pos), heads, d)  # [i, j, h, d]
    a = torch.einsum("bhid,bhjd->bhij", q, k)
    b = torch.einsum("bhid,ijhd->bhij", q, WR)
    c = torch.einsum("hd,bhjd->bhj", u, k)[:, :, None, :]
    e = torch.einsum("hd,ijhd->hij", v, WR)[None]
    return (a + b + c + e) * scale


def xl_scores(layer, q, k):
    L = q.shape[2]
    pos = torch.arange(L)
    return xl_four_terms(getattr(layer.self_attn, XL_ATTR), q, k, pos, pos, q.shape[-1] ** -0.5)


def test_xl_scores_equal_a_float64_hand_computation_of_the_four_terms():
    g = torch.Generator().manual_seed(3)
    xl = XLPositions(d_model=24, heads=3, head_dim=8)
    with torch.no_grad():
        for p in xl.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    q, k = torch.randn(2, 3, 5, 8, generator=g), torch.randn(2, 3, 9, 8, generator=g)
    q_pos, k_pos = torch.arange(4, 9), torch.arange(9)  # 5 queries after 4 cached keys
    want = xl_four_terms(xl, q, k, q_pos, k_pos, 8 ** -0.5)
    bidirectional = xl.scores(q, k, q_pos, k_pos, 8 ** -0.5, causal=False)
    assert max_diff(bidirectional.double(), want) < 1e-4 * want.abs().max()
    causal = xl.scores(q, k, q_pos, k_pos, 8 ** -0.5, causal=True)
    seen = k_pos[None, :] <= q_pos[:, None]  # the causal path skips the distances of masked keys
    assert max_diff(causal.double()[..., seen], want[..., seen]) < 1e-4 * want.abs().max()


@pytest.mark.parametrize("scheme", ["t5", "xl"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_llama_equals_the_hand_computation(scheme, attn):
    """GQA (4 heads, 2 KV heads), batch 2 with left and right padding, both attention implementations."""
    model = hfpatch.patch(tiny_model("llama", attn_implementation=attn), position=scheme)
    randomize_new_parameters(model)
    ids = tokens(24, batch=3)
    keep = torch.ones(3, 24, dtype=torch.long)
    keep[1, :7] = 0
    keep[2, -6:] = 0
    with torch.no_grad():
        got = model(ids, attention_mask=keep).logits
    want = llama_by_hand(model, ids, keep, t5_scores(model) if scheme == "t5" else xl_scores)
    real = keep.bool()
    assert max_diff(got[real].double(), want[real]) < 1e-4


@pytest.mark.parametrize("scheme", ["t5", "xl"])
def test_blocked_path_equals_all_queries_at_once_with_gradients(scheme, monkeypatch):
    """sdpa models take the queries a few at a time; eager ones all at once (returning the weights)."""
    ids = tokens(30, batch=2)
    outs = []
    for attn, block in (("eager", None), ("sdpa", 4 * 30 * 2 * 5)):  # blocks of 5 queries
        if block:
            monkeypatch.setattr(attention, "BLOCK_ELEMENTS", block)
        model = hfpatch.patch(tiny_model("qwen3", attn_implementation=attn), position=scheme)
        randomize_new_parameters(model)
        model.train()
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if "hfpatch" in n and p.grad is not None}
        outs.append((loss.detach(), grads))
    (l1, g1), (l2, g2) = outs
    assert abs(float(l1 - l2)) < 1e-5
    assert g1.keys() == g2.keys() and len(g1) > 0
    assert all(max_diff(g1[n], g2[n]) < 1e-4 for n in g1)


@pytest.mark.parametrize("kwargs", [dict(position="t5"), dict(position="xl"),
                                    dict(position="learned", table_size=40)], ids=lambda k: k["position"])
def test_cached_decoding_equals_the_full_forward(kwargs):
    model = hfpatch.patch(tiny_model("llama"), **kwargs)
    randomize_new_parameters(model)
    ids = tokens(30)
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :20], use_cache=True)
        cache, steps = out.past_key_values, [out.logits]
        for t in range(20, 30):
            out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    assert max_diff(torch.cat(steps, 1), full) < 1e-4


def test_t5_bidirectional_bucketing_in_bert():
    """BERT attends both ways: keys after the query get their own half of the buckets (T5's encoder)."""
    model = hfpatch.patch(tiny_model("bert", attn_implementation="eager"), position="t5", num_buckets=8,
                          max_distance=16)
    randomize_new_parameters(model)
    ids = tokens(20)
    with torch.no_grad():
        weights = model(ids, output_attentions=True).attentions[0][0]  # [H, L, L] of the first layer
        h = model.bert.embeddings(input_ids=ids)
        s = model.bert.encoder.layer[0].attention.self
        H, d = s.num_attention_heads, s.attention_head_size
        q = s.query(h).view(1, 20, H, d).transpose(1, 2)[0].double()
        k = s.key(h).view(1, 20, H, d).transpose(1, 2)[0].double()
    pos = torch.arange(20)
    buckets = T5Attention._relative_position_bucket(pos[None, :] - pos[:, None], True, 8, 16)
    table = getattr(model.bert, T5_TABLE).weight.double()
    want = torch.softmax(q @ k.transpose(-1, -2) * d ** -0.5 + table[buckets].permute(2, 0, 1), -1)
    assert max_diff(weights.double(), want) < 1e-5


# ------------------------------------------------------------------------------------------------------- learned

def test_learned_table_is_refused_beyond_its_length():
    model = tiny_model("llama")
    hfpatch.patch(model, position="learned", table_size=32, init_std=0.01)
    table = getattr(model.model.layers[0], TABLE_ATTR)
    assert table.weight.shape == (32, 64) and 0.005 < float(table.weight.detach().std()) < 0.015
    info = hfpatch.describe(model)
    assert info["position_limit"] == 32 and info["position"]["native"] is False
    with torch.no_grad():
        model(tokens(32))  # exactly the table
        with pytest.raises(ValueError, match="past the learned position table, which has 32 rows"):
            model(tokens(33))
    # the default size is the trained window (max_position_embeddings)
    assert hfpatch.introspect.position_limit(hfpatch.patch(tiny_model("qwen2"), position="learned")) == 64


@pytest.mark.parametrize("family,kwargs,message", [
    ("gpt2", dict(position="learned"), "already has one"),
    ("llama", dict(position="t5", num_buckets=2), "num_buckets must be at least 4"),
    ("llama", dict(position="t5", num_buckets=32, max_distance=16), "max_distance must be greater"),
    ("llama", dict(position="t5", num_buckets=8.5), "positive integer"),
    ("llama", dict(position="xl", factor=2.0), "does not take factor"),
    ("llama", dict(position="learned", table_size=0), "positive integer"),
])
def test_bad_requests_leave_the_model_untouched(family, kwargs, message):
    model = tiny_model(family)
    before = fingerprint(model)
    with pytest.raises(ValueError, match=message):
        hfpatch.patch(model, **kwargs)
    assert_same_fingerprint(fingerprint(model), before)


def test_new_parameters_start_at_zero_and_train():
    """t5 and xl start as NoPE (their parameters are zero), and one optimizer step moves them."""
    ids = tokens(20, batch=2)
    nope = hfpatch.patch(tiny_model("llama"), position="nope")
    for scheme in ("t5", "xl"):
        model = hfpatch.patch(tiny_model("llama"), position=scheme)
        new = {n: p for n, p in model.named_parameters() if "hfpatch" in n}
        assert new and all(torch.count_nonzero(p) == 0 for p in new.values())
        assert max_diff(logits(model, ids), logits(nope, ids)) < 1e-5
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model(ids, labels=ids).loss.backward()
        opt.step()
        assert any(torch.count_nonzero(p) > 0 for p in new.values())


# ------------------------------------------------------------------------------- through unpatch / save / reload

CASES = [(f, dict(position=s)) for f in ("llama", "gemma2", "gpt_neox", "gpt2", "bert") for s in ("t5", "xl")] + \
    [(f, dict(position="learned")) for f in ("llama", "gemma3_text", "gpt_neox", "phi3")] + \
    [(f, dict(norm="batchnorm")) for f in ("llama", "gemma2", "olmo2", "gpt2", "opt")]


@pytest.mark.parametrize("family,kwargs", CASES,
                         ids=lambda c: c if isinstance(c, str) else "+".join(map(str, c.values())))
def test_unpatch_save_and_reload(tmp_path, family, kwargs):
    model = tiny_model(family)
    x = tokens(24)
    ref, fp = logits(model, x), fingerprint(model)

    def patched():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the plain-swap warning (batchnorm)
            hfpatch.patch(model, **kwargs)
        randomize_new_parameters(model)
        if "norm" in kwargs:  # running statistics that are not the initial ones
            model.train()
            torch.manual_seed(0)  # gpt2 and opt have dropout
            with torch.no_grad():
                model(tokens(24, batch=2, seed=5))
            model.eval()
        return logits(model, x)

    expected = patched()
    assert max_diff(expected, ref) > 1e-4
    hfpatch.unpatch(model)
    assert max_diff(logits(model, x), ref) == 0.0
    assert_same_fingerprint(fingerprint(model), fp)
    assert max_diff(patched(), expected) == 0.0  # patched again: the same model
    if "position" in kwargs:
        with pytest.warns(UserWarning, match="plain transformers loads the model.s original position"):
            hfpatch.save_pretrained(model, tmp_path)
    else:
        hfpatch.save_pretrained(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["hfpatch"]["spec"] == hfpatch.describe(model)["applied"]
    loaded = hfpatch.from_pretrained(tmp_path).eval()
    assert max_diff(logits(loaded, x), expected) == 0.0
    assert hfpatch.describe(loaded)["applied"] == hfpatch.describe(model)["applied"]
