"""Attention computed as kernel calls over parts of the keys ("pieces"), merged by their log-sum-exp, with gradients.

A scheme whose scores differ by region (Dual Chunk Attention's three query positions; T5's per-distance bias near
the query and one constant beyond it) lists its pieces: which query tensor, which query rows, which key slots,
causal or not, an additive mask (padding, a bias). The forward runs each piece with a kernel that returns the
log-sum-exp of its scores (kernels.attend) and merges them (kernels.merge): exact, and no [queries, keys] tensor.

The backward uses what FlashAttention's backward uses: with P the merged softmax, O its output and L its
log-sum-exp, a piece's share of the gradient is its own attention backward with O and L in place of its own output
and log-sum-exp (P restricted to the piece is exp(S_p - L), and the row term rowsum(dO * O) is the whole row's).
So each piece runs its kernel's backward once more, given (dO, O, L):
- on the CPU torch's fused flash-attention backward (`_scaled_dot_product_flash_attention_for_cpu_backward`);
- elsewhere a blocked backward written with torch ops (`blocked_backward`): the scores of a block of query rows are
  recomputed, so memory stays O(rows x keys) per block.
Nothing but the inputs, O and L is kept between forward and backward: memory O(L), as for sdpa. The pieces are
made twice (forward and backward) by the caller's function, so their masks exist only while they run.

Masks and biases are constants here; a bias that is learned (T5's table) gets its gradient elsewhere
(relative.BiasGradient).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from . import kernels

BLOCK_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 25}  # scores per block of the torch-ops backward, per device
UNSEEN = kernels.FLOOR / 2  # a merged log-sum-exp below this: the row saw no key at all


@dataclass(frozen=True)
class Piece:
    """One kernel call: query rows `rows` of query tensor `query` against key slots `keys`."""

    query: int
    rows: slice
    keys: slice
    causal: bool = False  # top-left: row r of the piece sees its keys c <= r
    mask: Tensor | None = None  # additive [batch rows, 1 or H, rows, keys], the query's dtype (padding, a bias)
    batch: slice = field(default_factory=lambda: slice(None))  # batch rows
    shift: Tensor | None = None  # [H] float32: a constant bias of these keys, added to the piece's log-sum-exp


Pieces = Callable[[], Iterable[Piece]]  # makes the pieces (called once for the forward, once for the backward)


def attention(queries: Sequence[Tensor], key: Tensor, value: Tensor, pieces: Pieces,
              scale: float) -> tuple[Tensor, Tensor]:
    """softmax over the union of the pieces, (output [b, H, q, d] in value's dtype, log-sum-exp [b, H, q] float32).
    queries: [b, H, q, d] tensors (the pieces say which one each uses), key and value [b, KV, kv, d]. Gradients
    flow to the queries, the key and the value (not to masks or shifts)."""
    out, lse = _Merged.apply(_Spec(pieces, scale), key, value, *queries)
    return out, lse


@dataclass(frozen=True)
class _Spec:
    pieces: Pieces
    scale: float


def forward(queries: Sequence[Tensor], key: Tensor, value: Tensor, pieces: Iterable[Piece],
            scale: float) -> tuple[Tensor, Tensor]:
    """The merged (output, log-sum-exp) in float32 (float64 for float64 inputs)."""
    q0 = queries[0]
    acc = torch.promote_types(value.dtype, torch.float32)
    out = torch.zeros(*q0.shape[:3], value.shape[-1], dtype=acc, device=q0.device)
    lse = torch.full(q0.shape[:3], float("-inf"), dtype=acc, device=q0.device)
    for p in pieces:
        o, part = kernels.attend(queries[p.query][p.batch, :, p.rows], key[p.batch, :, p.keys],
                                 value[p.batch, :, p.keys], scale, mask=p.mask, causal=p.causal)
        if p.shift is not None:
            part = part + p.shift.to(part.dtype)[None, :, None]
        out[p.batch, :, p.rows], lse[p.batch, :, p.rows] = kernels.merge(out[p.batch, :, p.rows],
                                                                         lse[p.batch, :, p.rows], o, part)
    return out, lse


class _Merged(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, spec: _Spec, key: Tensor, value: Tensor, *queries: Tensor) -> tuple[Tensor, Tensor]:
        out, lse = forward(queries, key, value, spec.pieces(), spec.scale)
        out = out.to(value.dtype)
        ctx.spec = spec
        ctx.save_for_backward(key, value, out, lse, *queries)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor, _dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        key, value, out, lse, *queries = ctx.saved_tensors
        dq, dk, dv = backward(ctx.spec.pieces(), dout, queries, key, value, out, lse, ctx.spec.scale)
        return (None, dk, dv, *dq)


def backward(pieces: Iterable[Piece], dout: Tensor, queries: Sequence[Tensor], key: Tensor, value: Tensor,
             out: Tensor, lse: Tensor, scale: float) -> tuple[list[Tensor], Tensor, Tensor]:
    """(d queries, d key, d value) of the merged attention, each piece's kernel backward given the merged output and
    log-sum-exp."""
    acc = torch.promote_types(key.dtype, torch.float32)
    dq = [torch.zeros(q.shape, dtype=acc, device=q.device) for q in queries]
    dk = torch.zeros(key.shape, dtype=acc, device=key.device)
    dv = torch.zeros(value.shape, dtype=acc, device=value.device)
    # a row that saw no key: +inf, so that exp(score - lse) is 0 for every key (its output is 0 and stays so)
    lse = lse.masked_fill(lse < UNSEEN, float("inf"))
    dout = dout.to(value.dtype)
    for p in pieces:
        b, r, k = p.batch, p.rows, p.keys
        row_lse = lse[b, :, r] if p.shift is None else lse[b, :, r] - p.shift.to(lse.dtype)[None, :, None]
        gq, gk, gv = piece_backward(dout[b, :, r], queries[p.query][b, :, r], key[b, :, k], value[b, :, k],
                                    out[b, :, r], row_lse, scale, mask=p.mask, causal=p.causal)
        dq[p.query][b, :, r] += gq
        dk[b, :, k] += gk
        dv[b, :, k] += gv
    return [g.to(q.dtype) for g, q in zip(dq, queries, strict=True)], dk.to(key.dtype), dv.to(value.dtype)


FUSED_CPU_BACKWARD = True  # False: the CPU also takes the torch-ops backward (tests compare the two)


def piece_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, *,
                   mask: Tensor | None = None, causal: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of softmax(q·kᵀ·scale + mask) v given the output and log-sum-exp of the whole softmax that
    this call is part of. k/v may have fewer heads than q."""
    if q.device.type == "cpu" and FUSED_CPU_BACKWARD:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out.to(q.dtype), lse, 0.0, causal, attn_mask=mask, scale=scale)
    return blocked_backward(dout, q, k, v, out, lse, scale, mask=mask, causal=causal)


def blocked_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, *,
                     mask: Tensor | None = None, causal: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """piece_backward in torch ops, a block of query rows at a time (the scores of one block exist at once;
    grouped keys are not repeated: the query heads of a key head are stacked as rows). Float32 arithmetic (float64
    for float64 inputs)."""
    b, H, rows, _ = q.shape
    KV, n = k.shape[1], k.shape[2]
    g = H // KV
    acc = torch.promote_types(q.dtype, torch.float32)
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # [b, H, rows]: rowsum(dO * O)
    dq = torch.empty(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    kf, vf = k.to(acc), v.to(acc)
    step = max(1, BLOCK_ELEMENTS.get(q.device.type, BLOCK_ELEMENTS["cuda"]) // max(1, b * H * n))
    for s in range(0, rows, step):
        e = min(rows, s + step)
        m = e - s

        def grouped(t: Tensor, m: int = m) -> Tensor:  # [b, H, m, x] -> [b, KV, g * m, x]
            return t.reshape(b, KV, g * m, t.shape[-1])

        qs, dos = grouped(q[:, :, s:e].to(acc)), grouped(dout[:, :, s:e].to(acc))
        scores = (qs @ kf.transpose(2, 3)).view(b, H, m, n) * scale
        if mask is not None:
            scores = scores + mask[:, :, s:e].to(acc)
        if causal:
            above = torch.ones(m, n, dtype=torch.bool, device=q.device).triu_(s + 1)
            scores = scores.masked_fill(above, float("-inf"))
        p = (scores - lse[:, :, s:e, None].to(acc)).exp()
        dp = (dos @ vf.transpose(2, 3)).view(b, H, m, n)
        ds = p * (dp - delta[:, :, s:e, None])
        p, ds = grouped(p), grouped(ds)
        dv += p.transpose(2, 3) @ dos
        dk += (ds.transpose(2, 3) @ qs) * scale
        dq[:, :, s:e] = (ds @ kf).view(b, H, m, -1) * scale
    return dq, dk, dv
