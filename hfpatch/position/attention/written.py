"""Attention with its scores written out, shared by the attention functions hfpatch registers for eager models and
for what their fast paths cannot do (softcapping, gradients, ...): `explicit_attention` (self_extend.py, and below)
and `biased_attention` for schemes that add a term to the scores (ALiBi's explicit path, T5's relative bias,
Transformer-XL's relative encoding).

Queries are taken to be the last q_len of the key slots (no cache, or a DynamicCache): q_pos / k_pos are slot
positions, so a relative scheme sees the same distances with and without a KV cache, and padding (masked) does not
change the distances between real tokens."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

BLOCK_ELEMENTS = 1 << 24  # scores per block of queries when blocked (64 MB in fp32)


def explicit_attention(scores: Callable[[int, int], tuple[torch.Tensor, torch.Tensor | None]], value: torch.Tensor,
                       attention_mask: torch.Tensor | None, q_pos: torch.Tensor, k_pos: torch.Tensor, *,
                       softcap: float | None = None, causal: bool = True, dropout: float = 0.0,
                       training: bool = False, block: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Like transformers' eager attention, with the scores of query rows s:e given by `scores(s, e)` as (logits [b,
    H, e - s, kv], scaled; bias or None): softcapping of the logits, then the bias added, then the mask (bool:
    True = attend; float: additive; None: causal by q_pos / k_pos when `causal`), softmax in float32 (float64 for
    float64 inputs), dropout, times
    `value` ([b, H, kv, d], GQA already expanded). With `block`, a block of queries at a time (at most
    BLOCK_ELEMENTS scores exist at once) and no weights are kept. Returns (output [b, q, H, d], weights or None)."""
    b, h, kv_len, _ = value.shape
    q_len = q_pos.shape[0]
    step = q_len if not block else max(1, min(q_len, BLOCK_ELEMENTS // max(1, b * h * kv_len)))
    outs, weights = [], []
    for s in range(0, q_len, step):
        e = min(q_len, s + step)
        x, bias = scores(s, e)
        if softcap is not None:
            x = torch.tanh(x / softcap) * softcap
        if bias is not None:
            x = x + bias.to(x.dtype)
        if attention_mask is not None:
            m = attention_mask[:, :, s:e, :kv_len]
            x = x.masked_fill(~m, torch.finfo(x.dtype).min) if m.dtype == torch.bool else x + m
        elif causal and q_len > 1:  # transformers skipped the mask, counting on sdpa's is_causal
            x = x.masked_fill(k_pos[None, :] > q_pos[s:e, None], torch.finfo(x.dtype).min)
        w = torch.softmax(x, dim=-1, dtype=torch.promote_types(x.dtype, torch.float32)).to(value.dtype)
        w = torch.nn.functional.dropout(w, p=dropout, training=training)
        outs.append(torch.matmul(w, value))
        if not block:
            weights.append(w)
    out = torch.cat(outs, dim=2).transpose(1, 2).contiguous()
    return out, (torch.cat(weights, dim=2) if weights else None)


def biased_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None,
                     terms: Callable[..., tuple[torch.Tensor, torch.Tensor | None]], dropout: float = 0.0,
                     causal: bool = True, block: bool = True,
                     softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """softmax(scores + bias + mask) @ V where a scheme's `terms(query_block, key, q_pos, k_pos)` gives the logits
    and the bias of a block of queries. query [b, H, q, d], key/value [b, KV, kv, d] (GQA: KV divides H);
    attention_mask None, a bool mask (True = attend) or an additive float mask [b, 1, q, kv]. With `block`, memory is
    bounded by [b, H, block, kv] scores; without, the weights are returned like eager attention returns them."""
    q_len, kv_len = query.shape[2], key.shape[2]
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    value = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    k_pos = torch.arange(kv_len, device=query.device)
    q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)
    return explicit_attention(lambda s, e: terms(query[:, :, s:e], key, q_pos[s:e], k_pos), value, attention_mask,
                              q_pos, k_pos, softcap=softcap, causal=causal, dropout=dropout, training=module.training,
                              block=block)


def causal_of(module: nn.Module, is_causal: bool | None = None) -> bool:
    """Whether this call attends causally: the `is_causal` the model passed, else the module's own flag."""
    return getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
