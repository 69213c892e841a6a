"""Attention whose keys split by distance into a near band and the far rest, each part computed by a fast kernel
and the parts merged by their log-sum-exp (kernels.merge): exact, and no [queries, keys] tensor.

Distances are in slots: d = (query slot) - (key slot), the queries being the last q_len of the kv_len key slots
(no cache, or a DynamicCache). Causal attention only: keys with d < 0 are never seen.

- `two_maps_flex` / `two_maps_flash`: near keys (d < W) scored with one (query, key) pair, far keys (d >= W) with
  another (Self-Extend's neighbour and grouped positions): two flex_attention calls with region block masks, or two
  flash-attn calls (a sliding window for the band, a bottom-right causal call on the keys up to W back).
- `near_far_bias`: a bias that depends on the distance up to D and is one constant per head beyond it (T5's
  buckets: every distance from some D <= max_distance on shares the last bucket): per block of queries, the band
  as one kernel call with the bias as its additive mask, and the far keys as plain causal kernel calls whose
  log-sum-exp is shifted by the constant.
"""

from __future__ import annotations

import torch

from . import flex, kernels

PIECE_ROWS = 1024  # queries per block on the piece path: the band mask is [heads, rows, rows + D]


# -------------------------------------------------------------------------------------------- two position maps

def two_maps_flex(qn, kn, qg, kg, value, attention_mask, window: int, scaling: float, softcap=None,
                  compiled: bool = True):
    """Near keys (d < window) by (qn, kn), far keys (d >= window) by (qg, kg): [b, H, q, d] in value's dtype."""
    q_len, kv_len = qn.shape[2], kn.shape[2]
    mods = flex.softcapped(None, softcap)
    near = flex.block_mask(flex.Region(0, window - 1), q_len, kv_len, qn.device, attention_mask)
    parts = [flex.attention(qn, kn, value, scaling, mods, near, lse=True, compiled=compiled)]
    if kv_len - 1 >= window:  # the last query has far keys
        far = flex.block_mask(flex.Region(window, None), q_len, kv_len, qn.device, attention_mask)
        parts.append(flex.attention(qg, kg, value, scaling, mods, far, lse=True, compiled=compiled))
    out, _ = kernels.merge_parts(parts)
    return out.to(value.dtype)


def two_maps_flash(qn, kn, qg, kg, value, window: int, scaling: float, softcap=None):
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


# ------------------------------------------------------------------------------------------- near/far distance bias

def additive(mask, dtype):
    """A slice of the model's mask as an additive float mask of `dtype` (bool: True = attend). Masked scores get the
    dtype's lowest finite value, so a part in which a row sees no key keeps a finite log-sum-exp (it then weighs
    nothing in the merge)."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def near_far_bias(query, key, value, attention_mask, scaling: float, near: torch.Tensor, far: torch.Tensor):
    """Causal softmax(q·kᵀ·scaling + bias + mask) v where bias[h, d] = near[h, d] for d < D = near.shape[1] and
    far[h] for d >= D. query [b, H, q, d], key/value [b, KV, kv, d] (grouped as they are); attention_mask None or
    [b, 1, q, kv] (bool or additive). Returns [b, H, q, d] in value's dtype."""
    q_len, kv_len = query.shape[2], key.shape[2]
    D = near.shape[1]
    first = kv_len - q_len
    rows = min(PIECE_ROWS, q_len)
    lowest = torch.finfo(query.dtype).min
    # the band's bias for a block of `rows` queries against keys s - D + 1 .. s + rows - 1: it only depends on
    # the distance, so one [H, rows, rows + D - 1] mask serves every block
    r = torch.arange(rows, device=query.device)[:, None]
    c = torch.arange(rows + D - 1, device=query.device)[None]
    dist = r + D - 1 - c
    inside = (dist >= 0) & (dist < D)
    band = near.to(query.dtype)[:, dist.clamp(0, D - 1)].masked_fill(~inside, lowest)[None]
    far_shift = far.float()[None, :, None]
    outs = []
    for s in range(first, kv_len, rows):
        e = min(kv_len, s + rows)
        qr = slice(s - first, e - first)

        def model_mask(rsel, lo, hi):
            if attention_mask is None:
                return None
            return additive(attention_mask[:, :, qr][:, :, rsel, lo:hi], query.dtype)

        lo = max(0, s - D + 1)
        m = band[:, :, :e - s, lo - (s - D + 1):e - (s - D + 1)]
        if attention_mask is not None:
            given = attention_mask[:, :, qr, lo:e]
            m = torch.where(given, m, lowest) if given.dtype == torch.bool else (m + given).clamp(min=lowest)
        parts = [kernels.attend(query[:, :, qr], key[:, :, lo:e], value[:, :, lo:e], scaling, mask=m)]
        g = max(s, D)  # the first query slot with far keys (d >= D)
        if e > g:
            fr = slice(g - s, None)
            out = torch.zeros_like(parts[0][0], dtype=torch.float32)
            lse = torch.full(parts[0][1].shape, float("-inf"), device=query.device)
            o, l_ = kernels.attend(query[:, :, qr][:, :, fr], key[:, :, g - D:e - D], value[:, :, g - D:e - D],
                                   scaling, mask=model_mask(fr, g - D, e - D), causal=True)
            out[:, :, fr], lse[:, :, fr] = o.float(), l_.float() + far_shift
            if g > D:  # keys every far row sees
                o, l_ = kernels.attend(query[:, :, qr][:, :, fr], key[:, :, :g - D], value[:, :, :g - D], scaling,
                                       mask=model_mask(fr, 0, g - D))
                out[:, :, fr], lse[:, :, fr] = kernels.merge(out[:, :, fr], lse[:, :, fr], o, l_.float() + far_shift)
            parts.append((out, lse))
        merged, _ = kernels.merge_parts(parts)
        outs.append(merged.to(value.dtype))
    return torch.cat(outs, dim=2)
