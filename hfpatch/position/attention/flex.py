"""torch's flex_attention for the position schemes: one compiled function per process, block masks built from
block coordinates, and the rule for when compiling is worth it.

- Compiled once, with dynamic shapes (`torch.compile(flex_attention, dynamic=True, fullgraph=True)`): a new
  sequence length, batch or KV-cache length reuses the compiled kernel. Measured on the CPU: calls at 300 and 421
  tokens shared one compilation, and a KV-cache call (64 queries, 500 keys) another that later cache shapes reuse;
  compiled with static shapes, every new length compiled again (7-17 s each). A new kind of call (ALiBi vs T5,
  softcapping, a padding mask or none, log-sum-exp or not, gradients or not) is a new compilation.
- fullgraph: a graph break would quietly run flex_attention's reference implementation, which writes every score
  out ([L, L] memory); instead a failed compilation raises, the call goes to the scheme's next path
  (paths.PathUnavailable), and flex paths step aside for the rest of the process, with a warning.
- Scalars a score_mod or mask_mod captures are tensors: with dynamic shapes, a captured Python int or float becomes
  a symbol that the CPU kernel fails to lower.
- Compiling costs seconds to a minute. So a flex path only takes calls with at least COMPILE_MIN_SCORES query x key
  pairs until the kernel has been compiled in this process, and FLEX_MIN_SCORES afterwards (the measurements are
  next to the constants).
- Which keys a query sees is a `Region` of the distance d = (query slot) - (key slot) (queries are the last q_len
  of the key slots), intersected with the model's padding mask. Blocks of the BlockMask are classified from their
  corner distances (and the mask's block-wise any/all), so no [L, L] tensor is built for it.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, overload

import torch
from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException
from torch.nn.attention.flex_attention import AuxOutput, AuxRequest, BlockMask, flex_attention

from . import paths

# flex_attention's element-wise rules: score_mod(score, b, h, q_idx, kv_idx) -> score, mask_mod(b, h, q_idx, kv_idx)
# -> keep (each argument a tensor: traced, then compiled)
ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
BLOCK = 128  # flex's default block size, on the CPU also the kernel's split sizes
# Measured on the CPU (one thread; batch 2, 9 heads, head_dim 64; ALiBi with softcapping), per call, compiled flex
# vs written-out: 64 x 64 scores 1.7 vs 1.0 ms; 128 x 128 8 vs 11 ms; 1 x 4096 (a decoding step) 9 vs 17 ms;
# 1024 x 1024 0.11 vs 0.66 s; 2048 x 2048 0.52 vs 2.6 s. A first compilation took 7-15 s with torch's on-disk
# cache warm and about a minute without. So: compile for a call of at least 2048 x 2048 scores (the ~2 s it saves
# per call repay the compilation within one forward of a 30-layer model), and once compiled use flex from 8192
# scores up.
COMPILE_MIN_SCORES = 2048 * 2048
FLEX_MIN_SCORES = 8192
# Compilations the one compiled function may hold. Each kind of call (scheme's score_mod, region's mask_mod, a
# padding mask or none, log-sum-exp or not, gradients or not) is one; dynamo's default limit of 8 per function is
# reached by a process that evaluates three schemes with and without padding (seen on an H200: the ninth kind
# raised FailOnRecompileLimitHit out of the forward). Raised for these calls only.
RECOMPILE_LIMIT = 64

_compiled: Callable[..., torch.Tensor | tuple[torch.Tensor, AuxOutput]] | None = None
_timings: dict[str, float] = {}  # "first call": seconds of the first compiled call (compilation included)
_failed: dict[str, str] = {}  # "compile": why compiling failed in this process (flex paths then step aside)


def compiled_fn() -> Callable[..., torch.Tensor | tuple[torch.Tensor, AuxOutput]]:
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=True, fullgraph=True)
    return _compiled


def _uncompiled(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                **options: Any) -> torch.Tensor | tuple[torch.Tensor, AuxOutput]:
    """flex_attention as torch defines it, uncompiled (its reference implementation writes the scores out)."""
    return flex_attention(query, key, value, **options)


def worth_it(call: paths.Call) -> str | None:
    """Why a flex path should not take this call (too small to pay for compiling, or for the kernel; or flex failed
    to compile in this process), or None."""
    if _failed:
        return f"flex_attention failed to compile in this process ({_failed['compile']})"
    q_len, kv_len = call.q_len, call.kv_len
    scores = q_len * kv_len
    need = FLEX_MIN_SCORES if "first call" in _timings else COMPILE_MIN_SCORES
    if scores < need:
        state = "compiled" if "first call" in _timings else "not compiled yet"
        return (f"{q_len} x {kv_len} scores is below the {need:,} a flex call needs (flex is {state} in this "
                "process)")
    return None


def timings() -> dict[str, float]:
    """{"first call": seconds} once the compiled function has run in this process (compilation included)."""
    return dict(_timings)


@dataclass(frozen=True)
class Region:
    """Keys a query sees: lo <= d <= hi for d = query slot - key slot (None: unbounded)."""

    lo: int | None = 0
    hi: int | None = None

    def of_blocks(self, q_len: int, kv_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(any, all) [q blocks, kv blocks]: whether some / every (query, key) pair of a block is in the region."""
        offset = kv_len - q_len
        qs = torch.arange(0, q_len, BLOCK, device=device)
        qe = (qs + BLOCK).clamp(max=q_len) - 1
        ks = torch.arange(0, kv_len, BLOCK, device=device)
        ke = (ks + BLOCK).clamp(max=kv_len) - 1
        d_min = (qs[:, None] + offset) - ke[None, :]  # smallest distance in the block
        d_max = (qe[:, None] + offset) - ks[None, :]
        lo = -math.inf if self.lo is None else self.lo
        hi = math.inf if self.hi is None else self.hi
        return (d_max >= lo) & (d_min <= hi), (d_min >= lo) & (d_max <= hi)

    def mask_mod(self, offset: torch.Tensor, dense: torch.Tensor | None) -> MaskMod:
        """The element-wise rule for the kernel: region, and the padding mask [b, q, kv] (or [q, kv]) if given."""
        lo = None if self.lo is None else torch.tensor(self.lo, device=offset.device)
        hi = None if self.hi is None else torch.tensor(self.hi, device=offset.device)

        def inside(q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            d = q_idx + offset - kv_idx
            keep = d >= lo if lo is not None else d == d
            return keep & (d <= hi) if hi is not None else keep

        if dense is None:
            return lambda b, h, q_idx, kv_idx: inside(q_idx, kv_idx)
        if dense.dim() == 2:  # one mask for the whole batch
            return lambda b, h, q_idx, kv_idx: inside(q_idx, kv_idx) & dense[q_idx, kv_idx]
        return lambda b, h, q_idx, kv_idx: inside(q_idx, kv_idx) & dense[b, q_idx, kv_idx]


CAUSAL = Region(0, None)
EVERYTHING = Region(None, None)


def _dense_blocks(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(any, all) over BLOCK x BLOCK blocks of a bool mask [b, q, kv], a band of query blocks at a time (memory: one
    band, not a second [q, kv] copy)."""
    b, q_len, kv_len = dense.shape
    pad = -kv_len % BLOCK
    anys, alls = [], []
    band = BLOCK * 8
    for s in range(0, q_len, band):
        rows = dense[:, s:s + band]
        n = rows.shape[1]
        rpad = -n % BLOCK
        # padding: out-of-range keys/queries count as "attend" for all() and "not attend" for any()
        a = torch.nn.functional.pad(rows, (0, pad, 0, rpad), value=False)
        f = torch.nn.functional.pad(rows, (0, pad, 0, rpad), value=True)
        shape = (b, (n + rpad) // BLOCK, BLOCK, (kv_len + pad) // BLOCK, BLOCK)
        anys.append(a.view(shape).any(4).any(2))
        alls.append(f.view(shape).all(4).all(2))
    return torch.cat(anys, 1), torch.cat(alls, 1)


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [B, H, Qb, Kb] bool block map as BlockMask wants it: counts [B, H, Qb] and the kv block indices of each
    row, the chosen ones first, in order."""
    counts = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts.contiguous(), order.contiguous()


def block_mask(region: Region, q_len: int, kv_len: int, device: torch.device,
               mask: torch.Tensor | None = None) -> BlockMask:
    """The BlockMask of `region` intersected with the model's bool mask [b, 1, q, kv] (True = attend) or None."""
    offset = torch.tensor(kv_len - q_len, device=device)
    r_any, r_all = region.of_blocks(q_len, kv_len, device)
    dense = None
    if mask is None:
        any_b, all_b = r_any[None], r_all[None]
    else:
        dense = mask[:, 0, :, :kv_len]
        if dense.shape[0] == 1:
            dense = dense[0]
        d_any, d_all = _dense_blocks(dense if dense.dim() == 3 else dense[None])
        any_b, all_b = r_any[None] & d_any, r_all[None] & d_all
    partial = any_b & ~all_b
    n, idx = _ordered(partial[:, None])
    full_n, full_idx = _ordered(all_b[:, None])
    return BlockMask.from_kv_blocks(n, idx, full_n, full_idx, BLOCK_SIZE=BLOCK,
                                    mask_mod=region.mask_mod(offset, dense), seq_lengths=(q_len, kv_len))


def softcapped(score_mod: ScoreMod | None, cap: float | None, device: torch.device) -> ScoreMod | None:
    """score_mod applied after Gemma-2-style softcapping of the scaled logits: cap * tanh(score / cap)."""
    if cap is None:
        return score_mod
    # a tensor, not a float: compiled with dynamic shapes, a captured Python float becomes a symbolic scalar that
    # the CPU kernel cannot lower
    limit = torch.tensor(float(cap), device=device)
    if score_mod is None:
        return lambda score, b, h, q_idx, kv_idx: torch.tanh(score / limit) * limit
    return lambda score, b, h, q_idx, kv_idx: score_mod(torch.tanh(score / limit) * limit, b, h, q_idx, kv_idx)


@overload
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
              score_mod: ScoreMod | None = None, mask: BlockMask | None = None, *, lse: Literal[False] = False,
              compiled: bool = True) -> torch.Tensor: ...
@overload
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
              score_mod: ScoreMod | None = None, mask: BlockMask | None = None, *, lse: Literal[True],
              compiled: bool = True) -> tuple[torch.Tensor, torch.Tensor]: ...
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
              score_mod: ScoreMod | None = None, mask: BlockMask | None = None, *, lse: bool = False,
              compiled: bool = True) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """flex_attention on [b, H, n, d] tensors (grouped keys as they are). Returns the output [b, H, q, d] in the
    query's dtype, and with `lse` the log-sum-exp [b, H, q] (float32; -inf where a row sees no key)."""
    fn = compiled_fn() if compiled else _uncompiled
    if compiled and _failed:
        raise paths.PathUnavailable(_failed["compile"])
    gqa = query.shape[1] != key.shape[1]
    first = compiled and "first call" not in _timings
    t0 = time.perf_counter()
    aux = AuxRequest(lse=True) if lse else None
    try:
        with torch._dynamo.config.patch(recompile_limit=max(RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)):
            result = fn(query, key, value, score_mod=score_mod, block_mask=mask, scale=scale, enable_gqa=gqa,
                        return_aux=aux)
    except (TorchDynamoException, FailOnRecompileLimitHit) as e:  # fullgraph: never a silent [L, L] reference run
        if not compiled:
            raise
        _failed["compile"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
        warnings.warn(f"hfpatch: flex_attention failed to compile ({_failed['compile']}); this process uses the "
                      "next attention path instead", RuntimeWarning, stacklevel=2)
        raise paths.PathUnavailable(_failed["compile"]) from e
    if first:
        _timings["first call"] = round(time.perf_counter() - t0, 2)
    if isinstance(result, torch.Tensor):
        return result
    out, extra = result
    if not isinstance(extra, AuxOutput) or extra.lse is None:
        raise TypeError(f"flex_attention returned {type(extra).__name__} for return_aux=AuxRequest(lse=True), "
                        "not an AuxOutput with the log-sum-exp")
    return out, extra.lse
