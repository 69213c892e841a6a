"""Attention whose scores no kernel computes (Transformer-XL's position term depends on the query vector and the
distance together), with gradients and without keeping the attention weights: FlashAttention's scheme in torch ops.

- Forward: the scores of a block of queries at a time (`scores(q_block, s, e, hi, others)`), softmax, times the
  values; only the output O and the log-sum-exp L of each row are kept.
- Backward: the scores of each block are computed again (with autograd on, for that block only), P = exp(S - L),
  dV += Pᵀ·dO, dS = P * (dO·Vᵀ - rowsum(dO * O)), and autograd takes dS back through the block's score function to
  the query block and the other inputs (the keys, the scheme's parameters).
Memory is that of one block's scores (at most pieces.BLOCK_ELEMENTS of them) besides O(L) tensors, where the
written-out path keeps every block's weights for the backward pass ([L, L] per layer). The cost: the scores are
computed twice, as in FlashAttention's backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from . import pieces

# scores(query rows s:e [b, H, e - s, d], s, e, hi, others) -> [b, H, e - s, hi]: the scaled scores of those rows
# against key slots 0 .. hi - 1, softcapping and bias included, before the mask
Scores = Callable[[Tensor, int, int, int, Sequence[Tensor]], Tensor]


@dataclass(frozen=True)
class _Spec:
    scores: Scores
    mask: Tensor | None  # the model's mask [b, 1, q, kv] (bool: True = attend; or additive) or None
    causal: bool


def attention(scores: Scores, query: Tensor, others: Sequence[Tensor], value: Tensor,
              attention_mask: Tensor | None, causal: bool = True) -> Tensor:
    """softmax(scores + mask) @ value: query [b, H, q, d], value [b, H, kv, d] (grouped keys already repeated), the
    queries being the last q of the key slots; `others` the score function's other differentiable inputs. Returns
    the output [b, H, q, d] in value's dtype; gradients reach query, value and `others`."""
    return _Recomputed.apply(_Spec(scores, attention_mask, causal), query, value, *others)


def _rows(q: Tensor, kv_len: int) -> int:
    budget = pieces.BLOCK_ELEMENTS.get(q.device.type, pieces.BLOCK_ELEMENTS["cuda"])
    return max(1, min(q.shape[2], budget // max(1, q.shape[0] * q.shape[1] * kv_len)))


def _blocks(spec: _Spec, q_len: int, kv_len: int, step: int) -> Iterator[tuple[int, int, int]]:
    """(s, e, hi): query rows s:e and the key slots 0 .. hi - 1 they may see."""
    first = kv_len - q_len
    for s in range(0, q_len, step):
        e = min(q_len, s + step)
        yield s, e, (first + e if spec.causal else kv_len)


def _visible(spec: _Spec, x: Tensor, s: int, e: int, hi: int, kv_len: int, q_len: int) -> Tensor:
    """Scores with what rows s:e must not see at -inf: the model's mask, or causality by slot."""
    if spec.mask is not None:
        m = spec.mask[:, :, s:e, :hi]
        return x.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else x + m.to(x.dtype)
    if spec.causal:
        q_slots = torch.arange(kv_len - q_len + s, kv_len - q_len + e, device=x.device)
        above = torch.arange(hi, device=x.device)[None, :] > q_slots[:, None]
        return x.masked_fill(above, float("-inf"))
    return x


def _forward(spec: _Spec, query: Tensor, value: Tensor, others: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """(output, log-sum-exp) in float32 (float64 for float64 inputs), a block of query rows at a time."""
    b, H, q_len, _ = query.shape
    kv_len = value.shape[2]
    acc = torch.promote_types(value.dtype, torch.float32)
    out = torch.zeros(b, H, q_len, value.shape[-1], dtype=acc, device=query.device)
    lse = torch.full((b, H, q_len), float("-inf"), dtype=acc, device=query.device)
    for s, e, hi in _blocks(spec, q_len, kv_len, _rows(query, kv_len)):
        x = _visible(spec, spec.scores(query[:, :, s:e], s, e, hi, others).to(acc), s, e, hi, kv_len, q_len)
        row_lse = torch.logsumexp(x, -1)
        p = (x - _finite(row_lse)[..., None]).exp()
        out[:, :, s:e] = p.to(value.dtype) @ value[:, :, :hi]
        lse[:, :, s:e] = row_lse
    return out, lse


def _finite(lse: Tensor) -> Tensor:
    """A row that sees no key (log-sum-exp -inf) gets +inf instead: its weights exp(-inf - inf) are 0."""
    return lse.masked_fill(lse == float("-inf"), float("inf"))


def _backward(spec: _Spec, dout: Tensor, query: Tensor, value: Tensor, out: Tensor, lse: Tensor,
              others: Sequence[Tensor]) -> tuple[Tensor, Tensor, list[Tensor | None]]:
    q_len, kv_len = query.shape[2], value.shape[2]
    acc = torch.promote_types(value.dtype, torch.float32)
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # rowsum(dO * O)
    lse = _finite(lse)
    dq = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    dv = torch.zeros(value.shape, dtype=acc, device=value.device)
    d_others: list[Tensor | None] = [None] * len(others)
    leaves = [o.detach().requires_grad_() for o in others]
    vf = value.to(acc)
    for s, e, hi in _blocks(spec, q_len, kv_len, _rows(query, kv_len)):
        q_block = query[:, :, s:e].detach().requires_grad_()
        with torch.enable_grad():
            raw = spec.scores(q_block, s, e, hi, leaves)
        x = _visible(spec, raw.detach().to(acc), s, e, hi, kv_len, q_len)
        p = (x - lse[:, :, s:e, None]).exp()
        do = dout[:, :, s:e].to(acc)
        dv[:, :, :hi] += p.transpose(2, 3) @ do
        ds = p * (do @ vf[:, :, :hi].transpose(2, 3) - delta[:, :, s:e, None])
        dq[:, :, s:e], *grads = torch.autograd.grad(raw, [q_block, *leaves], ds.to(raw.dtype), allow_unused=True)
        for i, g in enumerate(grads):
            before = d_others[i]
            d_others[i] = g if before is None else before if g is None else before + g
    return dq, dv.to(value.dtype), d_others


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, spec: _Spec, query: Tensor, value: Tensor, *others: Tensor) -> Tensor:
        out, lse = _forward(spec, query, value, others)
        out = out.to(value.dtype)
        ctx.spec = spec
        ctx.save_for_backward(query, value, out, lse, *others)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        query, value, out, lse, *others = ctx.saved_tensors
        dq, dv, d_others = _backward(ctx.spec, dout, query, value, out, lse, others)
        return (None, dq, dv, *d_others)
