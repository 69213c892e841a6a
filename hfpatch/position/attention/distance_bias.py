"""The gradient of a learned bias that depends on the distance near the query and is one constant per head beyond:
bias[h, d] = near[h, d] for d = (query slot) - (key slot) < D, far[h] for d >= D (T5's buckets: every distance from
some D <= max_distance on shares the last bucket). Causal attention only.

Written as a kernel would write it (a score_mod reading the bias by distance, differentiated element by element),
every score adds its gradient into one of a few hundred table entries: on CUDA that is an atomic add per score into
the same few addresses (flex's T5 training measured 47x the unpatched model's time at 8k on an H200). Instead the
attention kernel runs with the bias as a constant, and `with_gradient` attaches the bias's gradient to its output:

- with P the softmax, O its output, dO the output's gradient and dS = P * (dO·vᵀ - rowsum(dO * O)) the gradient of
  the scores, the gradient of near[h, d] is the sum of dS over the (query, key) pairs at distance d: only the band
  of the D nearest keys of each query, recomputed a block of BAND_ROWS queries at a time from (q, k, v, O, L)
  (O(L x D) work, O(BAND_ROWS x D) memory) and summed along its diagonals by a gather (no atomics);
- every row of dS sums to zero (the softmax's weights sum to one), so the far keys' share is minus the band's:
  d far[h] = -sum_d d near[h, d]. The far keys are never recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from . import pieces

BAND_ROWS = 128  # queries per block of the band's recomputation


@dataclass(frozen=True)
class _Spec:
    mask: Tensor | None  # the model's attention mask [b, 1, q, kv] (bool: True = attend; or additive), or None
    scale: float
    softcap: float | None


def with_gradient(out: Tensor, lse: Tensor, near: Tensor, far: Tensor, query: Tensor, key: Tensor, value: Tensor,
                  attention_mask: Tensor | None, scale: float, softcap: float | None = None) -> Tensor:
    """`out` ([b, H, q, d], computed by any kernel with the bias held constant, and its log-sum-exp `lse` [b, H, q])
    unchanged, with the gradient of `near` [H, D] and `far` [H] attached. query [b, H, q, d], key/value [b, KV, kv,
    d] as the kernel got them (the queries are the last q of the key slots). Gradients to query, key and value
    come from the kernel's own backward, not from here."""
    if not (torch.is_grad_enabled() and (near.requires_grad or far.requires_grad)):
        return out
    return _BiasGradient.apply(_Spec(attention_mask, scale, softcap), out, lse.detach(), near, far,
                               query.detach(), key.detach(), value.detach())


class _BiasGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, spec: _Spec, out: Tensor, lse: Tensor, near: Tensor, far: Tensor, query: Tensor,
                key: Tensor, value: Tensor) -> Tensor:
        ctx.spec = spec
        ctx.save_for_backward(out, lse, near, query, key, value)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        out, lse, near, query, key, value = ctx.saved_tensors
        spec: _Spec = ctx.spec
        dnear = band_gradient(dout, out, lse, near, query, key, value, spec.mask, spec.scale, spec.softcap)
        return None, dout, None, dnear.to(near.dtype), (-dnear.sum(-1)).to(near.dtype), None, None, None


def band_gradient(dout: Tensor, out: Tensor, lse: Tensor, near: Tensor, query: Tensor, key: Tensor, value: Tensor,
                  attention_mask: Tensor | None, scale: float, softcap: float | None) -> Tensor:
    """[H, D]: the sum over the batch and the (query, key) pairs at each distance d < D of the scores' gradient."""
    b, H, q_len, _ = query.shape
    KV, kv_len, D = key.shape[1], key.shape[2], near.shape[1]
    g = H // KV
    acc = torch.promote_types(query.dtype, torch.float32)
    first = kv_len - q_len
    lse = lse.to(acc).masked_fill(lse < pieces.UNSEEN, float("inf"))  # a row that sees no key: weights 0
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # [b, H, q]
    rows = min(BAND_ROWS, q_len)
    r = torch.arange(rows, device=query.device)[:, None]
    dist = r + D - 1 - torch.arange(rows + D - 1, device=query.device)[None]  # block keys from slot s - D + 1
    inside = (dist >= 0) & (dist < D)
    band = near.detach().to(acc)[:, dist.clamp(0, D - 1)].masked_fill(~inside, float("-inf"))  # [H, rows, cols]
    t = torch.arange(D, device=query.device)
    dnear = torch.zeros(H, D, dtype=acc, device=query.device)
    for s in range(first, kv_len, rows):
        e = min(kv_len, s + rows)
        m = e - s
        lo = max(0, s - D + 1)
        cols = slice(lo - (s - D + 1), e - (s - D + 1))
        qs = query[:, :, s - first:e - first].to(acc).reshape(b, KV, g * m, -1)
        ks, vs = key[:, :, lo:e].to(acc), value[:, :, lo:e].to(acc)
        n = e - lo
        scores = (qs @ ks.transpose(2, 3)).view(b, H, m, n) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores + band[None, :, :m, cols]
        if attention_mask is not None:
            given = attention_mask[:, :, s - first:e - first, lo:e]
            scores = scores.masked_fill(~given, float("-inf")) if given.dtype == torch.bool else scores + given
        p = (scores - lse[:, :, s - first:e - first, None]).exp()
        dos = dout[:, :, s - first:e - first].to(acc).reshape(b, KV, g * m, -1)
        dp = (dos @ vs.transpose(2, 3)).view(b, H, m, n)
        ds = (p * (dp - delta[:, :, s - first:e - first, None])).sum(0)  # [H, m, n]
        # the key at distance t from block row i sits in column i + D - 1 - t - (lo - (s - D + 1))
        col = r[:m] + D - 1 - t[None] - cols.start
        valid = (col >= 0) & (col < n)
        picked = ds.gather(-1, col.clamp(0, n - 1).expand(H, m, D)).masked_fill(~valid, 0.0)
        dnear += picked.sum(1)
    return dnear
