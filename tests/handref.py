"""Float64 forwards of llama, qwen3 and gemma2 written here from their weights, with the attention given as a
function: the independent reference for the schemes that bring their own attention (Self-Extend, Dual Chunk
Attention)."""

import torch
import torch.nn.functional as F
from conftest import max_diff, tiny_model, tokens

import hfpatch


def rope(x, pos, theta):
    """RoPE from its definition (rotate-half layout), float64. x [b, h, L, d], pos [b, L] (or broadcastable)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = pos[..., None].double() * inv
    cos, sin = torch.cat([angle.cos()] * 2, -1)[:, None], torch.cat([angle.sin()] * 2, -1)[:, None]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def softmax_attention(scores, v, keep, softcap=None, sliding=None):
    """Causal softmax of float64 scores [b, H, L, L] with padding `keep` [b, L], softcapping and a sliding window."""
    L = scores.shape[-1]
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    allowed = (j <= i)[None] & keep[:, None, :].bool()
    if sliding is not None:
        allowed = allowed & (i - j < sliding)
    scores = scores.masked_fill(~allowed[:, None], -1e30)
    return torch.softmax(scores, -1) @ v


def rms(x, norm, offset=0.0):
    eps = getattr(norm, "variance_epsilon", None) or norm.eps
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + norm.weight.double())


def by_hand(model, ids, keep, pos, scores):
    """llama / qwen3 (q and k norms) / gemma2 (scaled embeddings, 1 + w norms, sandwich norms, softcapping, sliding
    layers, query_pre_attn_scalar) written from their weights, float64. `scores(q, k, pos, theta)` gives the
    attention logits [b, H, L, L] (before scaling) from un-rotated q [b, H, L, d] and k (GQA expanded)."""
    cfg, m = model.config, model.model
    fam, gemma = cfg.model_type, cfg.model_type == "gemma2"
    H, KV, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    b, L = ids.shape
    off = 1.0 if gemma else 0.0
    lin = lambda t, layer: t @ layer.weight.double().T
    x = m.embed_tokens.weight.double()[ids] * (cfg.hidden_size ** 0.5 if gemma else 1.0)
    for idx, layer in enumerate(m.layers):
        a = layer.self_attn
        h = rms(x, layer.input_layernorm, off)
        q, k, v = (lin(h, p).view(b, L, -1, d) for p in (a.q_proj, a.k_proj, a.v_proj))
        if fam == "qwen3":
            q, k = rms(q, a.q_norm), rms(k, a.k_norm)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
        sliding = cfg.sliding_window if gemma and cfg.layer_types[idx] == "sliding_attention" else None
        scale = (cfg.query_pre_attn_scalar if gemma else d) ** -0.5
        s = scores(q, k, pos, cfg.rope_parameters["rope_theta"]) * scale
        o = softmax_attention(s, v, keep, cfg.attn_logit_softcapping if gemma else None, sliding)
        o = lin(o.transpose(1, 2).reshape(b, L, H * d), a.o_proj)
        x = x + (rms(o, layer.post_attention_layernorm, off) if gemma else o)
        h = rms(x, layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm, off)
        act = (lambda t: F.gelu(t, approximate="tanh")) if gemma else F.silu
        f = lin(act(lin(h, layer.mlp.gate_proj)) * lin(h, layer.mlp.up_proj), layer.mlp.down_proj)
        x = x + (rms(f, layer.post_feedforward_layernorm, off) if gemma else f)
    out = lin(rms(x, m.norm, off), model.lm_head)
    if gemma:
        out = torch.tanh(out / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    return out


def patched_logits_by_hand(model, ids, keep, pos, scores):
    """The patched model's logits of (ids, padding mask `keep`, position ids `pos`), checked against by_hand's with
    `scores` at the real tokens (1e-4)."""
    with torch.no_grad():
        out = model(ids, attention_mask=keep, position_ids=pos).logits
    expected = by_hand(model, ids, keep, pos, scores)
    real = keep.bool()
    assert max_diff(out[real].double(), expected[real]) <= 1e-4
    return out


def patched_on(family, attn, names, **patch):
    """A tiny `family` model patched with `patch`, running the scheme's attention under its `names` = (eager name,
    sdpa name) for `attn`. transformers will not load gemma2 on sdpa (softcapping): there the sdpa name is set by
    hand."""
    model = tiny_model(family, attn_implementation="eager" if family == "gemma2" else attn)
    hfpatch.patch(model, **patch)
    if attn == "sdpa" and family == "gemma2":
        model.config._attn_implementation_internal = names[1]
    assert model.config._attn_implementation == (names[0] if attn == "eager" else names[1])
    return model


def assert_unpatched_differs(model, ids, keep, pos, out):
    """The scheme shows at this length: the unpatched model's logits (unpatching `model`) differ from `out` by more
    than 1e-3 at the real tokens."""
    real = keep.bool()
    unpatched = hfpatch.unpatch(model)(ids, attention_mask=keep, position_ids=pos).logits
    assert max_diff(unpatched[real], out[real]) > 1e-3


def padded(batch_len, padding):
    """(ids, attention mask, position ids as generate() makes them: counting real tokens only)."""
    ids = tokens(batch_len, batch=2)
    keep = torch.ones(2, batch_len, dtype=torch.long)
    if padding == "left":
        keep[1, :13] = 0
    elif padding == "right":
        keep[1, -13:] = 0
    pos = (keep.cumsum(-1) - 1).clamp(min=0)
    return ids, keep, pos


def skipping():
    """(ids, attention mask, position ids that skip, as PoSE or a short stand-in for a long sequence gives them): 48
    tokens at positions 0..15 then 200..231; the second row left-padded by 6 slots at position 0 (as generate() gives
    padding), then 0..9 and 200..231."""
    ids = tokens(48, batch=2)
    keep = torch.ones(2, 48, dtype=torch.long)
    keep[1, :6] = 0
    pos = torch.stack([torch.cat([torch.arange(16), torch.arange(200, 232)]),
                       torch.cat([torch.zeros(6, dtype=torch.long), torch.arange(10), torch.arange(200, 232)])])
    return ids, keep, pos


def segmented(lengths, jumps, padding="none"):
    """(ids, attention mask, position ids) of a batch of 2 whose positions skip, as PoSE or a proxy sample gives
    them: segments of `lengths` tokens, each segment's first position `jumps[k]` after the last one of segment k (1:
    no skip); the second row the same, or padded by 13 slots at position 0 (as generate() pads) on the left or the
    right, its real tokens at the first row's first positions."""
    segments, start = [], 0
    for n, jump in zip(lengths, [*jumps, 0], strict=True):
        segments.append(torch.arange(start, start + n))
        start += n - 1 + jump
    first = torch.cat(segments)
    L = len(first)
    ids = tokens(L, batch=2)
    keep = torch.ones(2, L, dtype=torch.long)
    second = first
    if padding == "left":
        keep[1, :13] = 0
        second = torch.cat([torch.zeros(13, dtype=torch.long), first[:-13]])
    elif padding == "right":
        keep[1, -13:] = 0
        second = torch.cat([first[:-13], torch.zeros(13, dtype=torch.long)])
    return ids, keep, torch.stack([first, second])


def cached_and_full(model):
    """(logits of a 4-token chunk and one step after a cached prefix, the full forward's last 5) with left padding
    and positions counting real tokens, as generate() makes them; and whether generate() with a cache equals it
    without one."""
    ids, keep, pos = padded(70, "left")
    with torch.no_grad():
        full = model(ids, attention_mask=keep, position_ids=pos).logits
        out = model(ids[:, :-5], attention_mask=keep[:, :-5], position_ids=pos[:, :-5], use_cache=True)
        chunk = model(ids[:, -5:-1], attention_mask=keep[:, :-1], position_ids=pos[:, -5:-1],
                      past_key_values=out.past_key_values, use_cache=True).logits
        step = model(ids[:, -1:], attention_mask=keep, position_ids=pos[:, -1:],
                     past_key_values=out.past_key_values, use_cache=True).logits
    kw = dict(attention_mask=keep, max_new_tokens=6, do_sample=False, pad_token_id=0)
    same = torch.equal(model.generate(ids, use_cache=True, **kw), model.generate(ids, use_cache=False, **kw))
    return torch.cat([chunk, step], 1), full[:, -5:], same


def gradients_by_name(**options):
    """{attn_implementation: {parameter: grad}} of a tiny llama patched with `options`, one loss on 40 tokens,
    through the sdpa name and the eager name."""
    grads = {}
    for attn in ("sdpa", "eager"):
        model = hfpatch.patch(tiny_model("llama", attn_implementation=attn), **options).train()
        x = tokens(40, batch=2)
        model(x, labels=x).loss.backward()
        grads[attn] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return grads
