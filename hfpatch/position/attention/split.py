"""Attention whose keys split by distance into a near band and the far rest, each part computed by a fast kernel
and the parts merged by their log-sum-exp (kernels.merge): exact, and no [queries, keys] tensor.

Distances are in slots: d = (query slot) - (key slot), the queries being the last q_len of the kv_len key slots
(no cache, or a DynamicCache). Causal attention only: keys with d < 0 are never seen.

- `two_maps_flex` / `two_maps_flash` / `two_maps_fa4`: near keys (d < W) scored with one (query, key) pair, far
  keys (d >= W) with another (Self-Extend's neighbour and grouped positions): two flex_attention calls with region
  block masks, or two flash-attn (FlashAttention-4) calls (a sliding window for the band, a bottom-right causal call
  on the keys up to W back).
- `near_far_bias`: a bias that depends on the distance up to D and is one constant per head beyond it (T5's
  buckets: every distance from some D <= max_distance on shares the last bucket): the band in blocks of queries,
  one kernel call each with the bias as its additive mask, and the far keys as plain causal kernel calls (the
  whole sequence at once when there is no padding mask) whose log-sum-exp is shifted by the constant; pieces.py
  runs them, gradients included.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from . import fa4, flex, kernels, pieces

PIECE_ROWS = 1024  # queries per block where a padding mask is made additive: [batch, rows, keys] floats
BAND_ROWS = 128  # queries per band call of near_far_bias: the call covers rows + D - 1 keys, D of them in the band


# -------------------------------------------------------------------------------------------- two position maps

def two_maps_flex(qn: torch.Tensor, kn: torch.Tensor, qg: torch.Tensor, kg: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, window: int, scaling: float, softcap: float | None = None,
                  compiled: bool = True) -> torch.Tensor:
    """Near keys (d < window) by (qn, kn), far keys (d >= window) by (qg, kg): [b, H, q, d] in value's dtype."""
    q_len, kv_len = qn.shape[2], kn.shape[2]
    mods = flex.softcapped(None, softcap, qn.device)
    near = flex.block_mask(flex.Region(0, window - 1), q_len, kv_len, qn.device, attention_mask)
    parts = [flex.attention(qn, kn, value, scaling, mods, near, lse=True, compiled=compiled)]
    if kv_len - 1 >= window:  # the last query has far keys
        far = flex.block_mask(flex.Region(window, None), q_len, kv_len, qn.device, attention_mask)
        parts.append(flex.attention(qg, kg, value, scaling, mods, far, lse=True, compiled=compiled))
    out, _ = kernels.merge_parts(parts)
    return out.to(value.dtype)


def two_maps_flash(qn: torch.Tensor, kn: torch.Tensor, qg: torch.Tensor, kg: torch.Tensor, value: torch.Tensor,
                   window: int, scaling: float, softcap: float | None = None) -> torch.Tensor:
    """The same with flash-attn (no padding mask): the band is a causal sliding window of `window` keys (key i -
    window + 1 .. i); the far part is a causal call against the keys up to slot kv_len - 1 - window, which
    flash-attn aligns bottom-right, so query slot p sees keys <= p - window. Output [b, q, H, d]."""
    q_len, kv_len = qn.shape[2], kn.shape[2]
    cap = softcap or 0.0
    out, lse = kernels.flash_attn(qn, kn, value, scaling, causal=True, window=(window - 1, 0), softcap=cap, lse=True)
    far_keys = kv_len - window
    if far_keys <= 0:
        return out
    parts = [(out.transpose(1, 2), lse)]
    o2, l2 = kernels.flash_attn(qg, kg[:, :, :far_keys], value[:, :, :far_keys], scaling, causal=True, softcap=cap,
                                lse=True)
    slots = torch.arange(kv_len - q_len, kv_len, device=qn.device)
    l2 = l2.masked_fill(slots < window, float("-inf"))  # rows with no far key (flash-attn leaves them undefined)
    parts.append((o2.transpose(1, 2), l2))
    merged, _ = kernels.merge_parts(parts)
    return merged.to(value.dtype).transpose(1, 2).contiguous()


def two_maps_fa4(qn: torch.Tensor, kn: torch.Tensor, qg: torch.Tensor, kg: torch.Tensor, value: torch.Tensor,
                 window: int, scaling: float, softcap: float | None = None) -> torch.Tensor:
    """The same with FlashAttention-4 (no padding mask; gradients too, through FA4's own backward and the merge):
    the band a causal sliding window of `window` keys, the far part a bottom-right causal call on the keys up to
    slot kv_len - 1 - window. Output [b, q, H, d]."""
    q_len, kv_len = qn.shape[2], kn.shape[2]
    out, lse = fa4.attend(qn, kn, value, scaling, causal=True, window=(window - 1, 0), softcap=softcap)
    far_keys = kv_len - window
    if far_keys <= 0:
        return out.transpose(1, 2).contiguous()
    o2, l2 = fa4.attend(qg, kg[:, :, :far_keys], value[:, :, :far_keys], scaling, causal=True, softcap=softcap)
    none = torch.arange(kv_len - q_len, kv_len, device=qn.device) < window  # rows with no far key
    o2 = torch.where(none[:, None], torch.zeros((), dtype=o2.dtype, device=o2.device), o2)
    l2 = l2.masked_fill(none, float("-inf"))
    merged, _ = kernels.merge_parts([(out, lse), (o2, l2)])
    return merged.to(value.dtype).transpose(1, 2).contiguous()


# ------------------------------------------------------------------------------------------- near/far distance bias

def additive(mask: Any, dtype: Any) -> torch.Tensor:
    """A slice of the model's mask as an additive float mask of `dtype` (bool: True = attend). Masked scores get the
    dtype's lowest finite value, so a part in which a row sees no key keeps a finite log-sum-exp (it then weighs
    nothing in the merge)."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def near_far_bias(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                  scaling: float, near: torch.Tensor, far: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax(q·kᵀ·scaling + bias + mask) v where bias[h, d] = near[h, d] for d < D = near.shape[1] and
    far[h] for d >= D. query [b, H, q, d], key/value [b, KV, kv, d] (grouped as they are); attention_mask None or
    [b, 1, q, kv] (bool or additive). Returns (output [b, H, q, d] in value's dtype, log-sum-exp [b, H, q]).
    Gradients reach query, key and value (pieces.attention); near and far are constants here (their gradient:
    distance_bias.with_gradient)."""
    made = near_far_pieces(query.shape[2], key.shape[2], attention_mask, near.detach(), far.detach(), query.dtype)
    return pieces.attention([query], key, value, made, scaling)


def near_far_pieces(q_len: int, kv_len: int, attention_mask: torch.Tensor | None, near: torch.Tensor,
                    far: torch.Tensor, dtype: torch.dtype) -> pieces.Pieces:
    """The pieces of near_far_bias: the band (distances 0 .. D - 1) in blocks of BAND_ROWS queries, each one kernel
    call whose additive mask is the bias (and the dtype's lowest value off the band); the far keys (distances >= D)
    as plain kernel calls whose log-sum-exp is shifted by far[h]: query slot p sees keys <= p - D, a top-left causal
    call and the keys every one of its queries sees; without a padding mask one block for all queries, with one
    blocks of PIECE_ROWS (so that the additive mask made from the model's bool mask stays a block)."""
    def made() -> Iterator[pieces.Piece]:
        yield from _band(q_len, kv_len, attention_mask, near, dtype)
        yield from _far(q_len, kv_len, attention_mask, near.shape[1], far, dtype)
    return made


def _band(q_len: int, kv_len: int, attention_mask: torch.Tensor | None, near: torch.Tensor,
          dtype: torch.dtype) -> Iterator[pieces.Piece]:
    """The keys at distances 0 .. D - 1 with their bias. The bias only depends on the distance, so one [H, rows,
    rows + D - 1] mask serves every block."""
    D = near.shape[1]
    first = kv_len - q_len
    rows = min(BAND_ROWS, q_len)
    lowest = torch.finfo(dtype).min
    r = torch.arange(rows, device=near.device)[:, None]
    dist = r + D - 1 - torch.arange(rows + D - 1, device=near.device)[None]  # block keys from s - D + 1
    inside = (dist >= 0) & (dist < D)
    band = near.to(dtype)[:, dist.clamp(0, D - 1)].masked_fill(~inside, lowest)[None]
    for s in range(first, kv_len, rows):
        e = min(kv_len, s + rows)
        lo = max(0, s - D + 1)
        m = band[:, :, :e - s, lo - (s - D + 1):e - (s - D + 1)]
        if attention_mask is not None:
            given = attention_mask[:, :, s - first:e - first, lo:e]
            m = torch.where(given, m, lowest) if given.dtype == torch.bool else (m + given).clamp(min=lowest)
        yield pieces.Piece(0, slice(s - first, e - first), slice(lo, e), mask=m)


def _far(q_len: int, kv_len: int, attention_mask: torch.Tensor | None, D: int, far: torch.Tensor,
         dtype: torch.dtype) -> Iterator[pieces.Piece]:
    """Plain attention over the keys at distances >= D (query slot p sees keys <= p - D), shifted by far[h]."""
    first = kv_len - q_len
    step = q_len if attention_mask is None else PIECE_ROWS
    for s in range(first, kv_len, step):
        e = min(kv_len, s + step)
        g = max(s, D)  # the first query slot with far keys
        if e <= g:
            continue
        rows = slice(g - first, e - first)

        def mask(lo: int, hi: int, rows: slice = rows) -> torch.Tensor | None:
            return None if attention_mask is None else additive(attention_mask[:, :, rows, lo:hi], dtype)

        # top-left causal over keys g - D .. e - D - 1: query slot p sees keys <= p - D
        yield pieces.Piece(0, rows, slice(g - D, e - D), causal=True, mask=mask(g - D, e - D), shift=far)
        if g > D:  # keys every one of these queries sees
            yield pieces.Piece(0, rows, slice(0, g - D), mask=mask(0, g - D), shift=far)
