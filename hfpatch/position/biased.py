"""Attention with the scores written out, for position schemes that add a term to them (ALiBi's explicit path, T5's
relative bias, Transformer-XL's relative encoding).

`attention` computes softmax(scores + mask) @ V where a scheme's `terms(query_block, key, q_pos, k_pos)` gives the
scores of a block of queries as (logits, bias): the logits go through softcapping (gemma2) when the model asks for it,
the bias is added after it (None: no bias). With `block=True` the queries are taken a block at a time, so at most
[batch, heads, block, keys] scores exist at once (memory bounded however long the sequence); with `block=False` all at
once, and the attention weights are returned like eager attention returns them.

Queries are taken to be the last q_len of the key slots (no cache, or a DynamicCache): q_pos / k_pos are slot
positions, so a relative scheme sees the same distances with and without a KV cache, and padding (masked) does not
change the distances between real tokens.
"""

from __future__ import annotations

import torch

BLOCK_ELEMENTS = 1 << 24  # scores per block (64 MB in fp32)


def attention(module, query, key, value, attention_mask, terms, dropout=0.0, causal=True, block=True, softcap=None):
    """query [b, H, q, d], key/value [b, KV, kv, d] (GQA: KV divides H); attention_mask None, a bool mask (True =
    attend) or an additive float mask [b, 1, q, kv]. Returns (out [b, q, H, d], weights or None)."""
    b, h, q_len, _ = query.shape
    kv_len = key.shape[2]
    groups = h // key.shape[1]
    key = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    value = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    k_pos = torch.arange(kv_len, device=query.device)
    q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)
    step = q_len if not block else max(1, min(q_len, BLOCK_ELEMENTS // max(1, b * h * kv_len)))
    outs, weights = [], []
    for s in range(0, q_len, step):
        e = min(q_len, s + step)
        scores, bias = terms(query[:, :, s:e], key, q_pos[s:e], k_pos)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if bias is not None:
            scores = scores + bias.to(scores.dtype)
        if attention_mask is not None:
            m = attention_mask[:, :, s:e, :kv_len]
            scores = scores.masked_fill(~m, torch.finfo(scores.dtype).min) if m.dtype == torch.bool else scores + m
        elif causal and q_len > 1:  # transformers skipped the mask, counting on sdpa's is_causal
            scores = scores.masked_fill(k_pos[None, :] > q_pos[s:e, None], torch.finfo(scores.dtype).min)
        w = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        w = torch.nn.functional.dropout(w, p=dropout, training=module.training)
        outs.append(torch.matmul(w, value))
        if not block:
            weights.append(w)
    out = torch.cat(outs, dim=2).transpose(1, 2).contiguous()
    return out, (torch.cat(weights, dim=2) if weights else None)


def is_causal(module, is_causal=None) -> bool:
    """Whether this call attends causally: the `is_causal` the model passed, else the module's own flag."""
    return getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
