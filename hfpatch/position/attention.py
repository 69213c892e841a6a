"""Attention with its scores written out, shared by the attention functions hfpatch registers (alibi.py,
self_extend.py) for eager models and for what their fast paths cannot do (softcapping, gradients, ...)."""

from __future__ import annotations

import torch

BLOCK_ELEMENTS = 1 << 24  # scores per block of queries when blocked (64 MB in fp32)


def explicit_attention(scores, value, attention_mask, q_pos, k_pos, *, softcap=None, bias=None, causal=True,
                       dropout=0.0, training=False, block=False):
    """Like transformers' eager attention, with the scores of query rows s:e given by `scores(s, e)` ([b, H, e - s,
    kv], scaled): softcapping, then `bias(s, e)` added, then the mask (bool: True = attend; float: additive; None:
    causal by q_pos / k_pos when `causal`), softmax in float32, dropout, times `value` ([b, H, kv, d], GQA already
    expanded). With `block`, a block of queries at a time (at most BLOCK_ELEMENTS scores exist at once) and no weights
    are kept. Returns (output [b, q, H, d], weights or None)."""
    b, h, kv_len, _ = value.shape
    q_len = q_pos.shape[0]
    step = q_len if not block else max(1, min(q_len, BLOCK_ELEMENTS // max(1, b * h * kv_len)))
    outs, weights = [], []
    for s in range(0, q_len, step):
        e = min(q_len, s + step)
        x = scores(s, e)
        if softcap is not None:
            x = torch.tanh(x / softcap) * softcap
        if bias is not None:
            x = x + bias(s, e).to(x.dtype)
        if attention_mask is not None:
            m = attention_mask[:, :, s:e, :kv_len]
            x = x.masked_fill(~m, torch.finfo(x.dtype).min) if m.dtype == torch.bool else x + m
        elif causal and q_len > 1:  # transformers skipped the mask, counting on sdpa's is_causal
            x = x.masked_fill(k_pos[None, :] > q_pos[s:e, None], torch.finfo(x.dtype).min)
        w = torch.softmax(x, dim=-1, dtype=torch.float32).to(value.dtype)
        w = torch.nn.functional.dropout(w, p=dropout, training=training)
        outs.append(torch.matmul(w, value))
        if not block:
            weights.append(w)
    out = torch.cat(outs, dim=2).transpose(1, 2).contiguous()
    return out, (torch.cat(weights, dim=2) if weights else None)
