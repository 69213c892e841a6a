"""Attention kernels that also return the log-sum-exp of their scores, and the merge of partial attentions by it.

A scheme whose scores differ by region (Self-Extend: neighbour keys at their own positions, far keys at grouped
ones; T5: a per-distance bias near the query, one constant bias beyond) attends each region with a plain kernel and
merges the parts: with o_p = softmax over part p (weights summing to one) and l_p = log-sum-exp of its scores,
the whole softmax is sum_p o_p * exp(l_p - L), L = log(sum_p exp(l_p)). This is exact, and memory stays that of the
kernels (no [queries, keys] tensor).

`attend` is one kernel call: causal means top-left aligned (row r sees keys c <= r, whatever the shapes), `mask` an
additive float mask. On the CPU it is torch's flash-attention kernel; on CUDA torch's flash kernel (fp16/bf16,
no mask, square when causal) or its memory-efficient kernel (any dtype, a mask) — both return the log-sum-exp.
None of these pass gradients through the log-sum-exp, so the paths built on them are for inference.

flash-attn (the package) is an optional extra, imported where it is used.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

MIN = torch.finfo(torch.float32).min
ALIGN = 16  # elements: the alignment torch's sdpa gives the bias of its memory-efficient kernel
FLOOR = -1e30  # log-sum-exp of a part a row sees nothing of, for merging: exp(FLOOR - any real lse) is 0


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, mask: torch.Tensor | None = None,
           causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [b, H, q, d], log-sum-exp [b, H, q] float32) of softmax(q·kᵀ·scale + mask) v. k/v may have fewer
    heads than q (grouped-query attention). A row that sees no key (every key masked by the dtype's lowest value
    or -inf, or above the diagonal) gets output 0 and log-sum-exp -inf, so it weighs nothing in `merge`."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                              scale=scale)[:2]
    else:
        out, lse = _attend_cuda(q, k, v, scale, mask, causal)
    if mask is None:  # without a mask every row sees a key (causal calls here are top-left: row r sees key 0)
        return out, lse
    return _without_unseen_rows(out, lse, _rows_seeing_a_key(mask, causal, q.shape[2], k.shape[2]))


def _rows_seeing_a_key(mask: torch.Tensor, causal: bool, q_len: int, kv_len: int) -> torch.Tensor:
    """[b, 1 or H, q] bool: whether the row sees at least one key through the additive mask (and the top-left
    causal rule). The kernels disagree on what such a row's log-sum-exp is (the CPU one gives about the mask value,
    CUDA's memory-efficient kernel a finite number that a merge then weighs: seen on an H200), so it is decided
    here rather than read off the kernel."""
    visible = mask > torch.finfo(mask.dtype).min
    if causal:
        visible = visible & torch.ones(q_len, kv_len, dtype=torch.bool, device=mask.device).tril_()
    return visible.any(-1)


def _without_unseen_rows(out: torch.Tensor, lse: torch.Tensor, seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output 0 and log-sum-exp -inf where a row sees no key."""
    return out.masked_fill(~seen[..., None], 0.0), lse.masked_fill(~seen, float("-inf"))


def _attend_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
                 causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # neither CUDA kernel takes grouped keys here
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    q_len, kv_len, d = q.shape[2], k.shape[2], q.shape[-1]
    square = q_len == kv_len
    if mask is None and (square or not causal) and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 \
            and d <= 256:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, _empty_rows(lse)
    if causal and not square:  # alignment of non-square causal kernels differs between kernels: spell it out
        above = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).triu_(1)
        tri = torch.zeros(q_len, kv_len, dtype=q.dtype, device=q.device).masked_fill_(above, MIN)
        mask, causal = (tri if mask is None else mask.to(q.dtype) + tri), False
    bias = None if mask is None else _aligned_bias(mask.to(q.dtype), q.shape[0], q.shape[1], q_len, kv_len)
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal,
                                                                      scale=scale)[:2]
    return out, _empty_rows(lse[..., :q_len])  # the kernel pads the log-sum-exp to a multiple of 32 rows


def _aligned_bias(mask: torch.Tensor, b: int, h: int, q_len: int, kv_len: int) -> torch.Tensor:
    """The bias as the memory-efficient kernel reads it, broadcast to [b, H, q, kv]. The kernel wants the bias's
    start address and its row stride aligned (torch's sdpa pads the last dimension to a multiple of 16 elements for
    it); a slice of a larger mask (a block of the band, say) is neither, and the kernel refuses it ("attn_bias_ptr
    is not correctly aligned"). Such a mask is copied into a fresh, padded buffer and sliced back."""
    if not _is_aligned(mask):
        padded = mask.new_zeros(*mask.shape[:-1], kv_len + (-kv_len % ALIGN))
        padded[..., :kv_len] = mask
        mask = padded[..., :kv_len]
    return mask.expand(b, h, q_len, kv_len)


def _is_aligned(mask: torch.Tensor) -> bool:
    """Start address a multiple of 16 elements, last dimension contiguous, and every other stride of a dimension
    longer than one a multiple of 16 elements."""
    strides = [s for s, n in zip(mask.stride()[:-1], mask.shape[:-1], strict=True) if n > 1]
    return (mask.data_ptr() % (ALIGN * mask.element_size()) == 0 and mask.stride(-1) == 1
            and all(s % ALIGN == 0 for s in strides))


def _empty_rows(lse: torch.Tensor) -> torch.Tensor:
    """flash-style kernels give +inf as the log-sum-exp of a row that sees no key; it weighs nothing: -inf."""
    return lse.masked_fill(lse == float("inf"), float("-inf"))


def merge(acc: torch.Tensor, lse: torch.Tensor, out: torch.Tensor,
          part_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one part (out [b, H, q, d], part_lse [b, H, q]) into the running (acc, lse), float32 (float64 for float64
    inputs); returns the new (acc, lse). A row that sees no key in a part (lse -inf) takes nothing from it. The
    log-sum-exps are floored at FLOOR first: a row that sees no key at all then averages two empty outputs instead of
    computing exp(-inf + inf), and its gradients stay finite (0, not NaN)."""
    a, b = lse.clamp(min=FLOOR), part_lse.to(_wide(part_lse)).clamp(min=FLOOR)
    total = torch.logaddexp(a, b)
    acc = acc * (a - total).exp().unsqueeze(-1) + out.to(_wide(out)) * (b - total).exp().unsqueeze(-1)
    return acc, total


def _wide(t: torch.Tensor) -> torch.dtype:
    """The dtype merges run in: float32, or float64 for float64 inputs."""
    return torch.promote_types(t.dtype, torch.float32)


def merge_parts(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax over the union of the parts [(out, lse), ...], as float32 (out, lse)."""
    (acc, lse), rest = parts[0], parts[1:]
    acc, lse = acc.to(_wide(acc)), _empty_rows(lse.to(_wide(lse)))
    for out, part_lse in rest:
        acc, lse = merge(acc, lse, out, _empty_rows(part_lse))
    return acc, lse


# ------------------------------------------------------------------------------------------------------ flash-attn

def flash_attn_missing() -> str | None:
    """Why the flash-attn package (FlashAttention-2) cannot run here, or None. flash-attn-4 installs `flash_attn`
    as a namespace package holding only `flash_attn.cute` (no origin): that is not flash-attn."""
    spec = importlib.util.find_spec("flash_attn")
    if spec is None:
        return "the flash-attn package is not installed"
    if spec.origin is None:
        return "the flash-attn package is not installed (flash_attn holds only flash-attn-4's flash_attn.cute)"
    if not torch.cuda.is_available():
        return "flash-attn needs a CUDA device"
    return None


def flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, causal: bool,
               window: tuple[int, int] = (-1, -1), alibi_slopes: torch.Tensor | None = None, softcap: float = 0.0,
               dropout: float = 0.0, lse: bool = False) -> Any:
    """flash-attn 2's flash_attn_func on [b, H, n, d] tensors (it takes [b, n, H, d]; grouped keys as they are).
    Causal is bottom-right aligned (the queries are the last q of the keys); `window` = (left, right) keys around
    the diagonal. Returns the output [b, q, H, d] (the layout transformers wants), and with `lse` its log-sum-exp
    [b, H, q] (+inf where a row sees no key: see `merge`)."""
    from flash_attn import flash_attn_func  # optional extra: only on CUDA machines that have it

    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout,
                          softmax_scale=scale, causal=causal, window_size=window, softcap=softcap,
                          alibi_slopes=alibi_slopes, return_attn_probs=lse)
    if not lse:
        return out
    return out[0], _empty_rows(out[1])
