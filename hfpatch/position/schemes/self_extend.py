"""Self-Extend (Jin et al., 2024, "LLM Maybe LongLM: Self-Extend LLM Context Window Without Tuning").

Query i attends key j (positions) with RoPE at
- their own positions when i - j < W, the neighbour window: exactly what the model was trained on;
- grouped positions otherwise: the key at floor(j / G), the query at floor(i / G) + W - floor(W / G). The shift makes
  the two regions meet: at i - j = W the grouped distance is W again (W or W + 1 when G does not divide W), and
  beyond it grows G times slower, so L tokens use relative positions up to about W + (L - W) / G.
One softmax runs over both regions. Regions and maps both come from the positions the model is given
(position_ids), so position ids that skip (PoSE training, a short sample standing in for a long one) are attended as
the full sequence would be: a key just before a jump is grouped for the queries after it.

Two position maps, acting at the rotary level (rotated.py: the attention function rotates q and k itself, at both
maps, with the family's own RoPE; the KV cache holds un-rotated keys). Whether this reproduces the family's attention
is checked numerically when patching: with every key inside the window, the patched model must give the unpatched
model's logits on a probe input; if not, the patch is refused.

Attention functions registered with transformers (each with its mask function):
- "hfpatch_self_extend" (models on sdpa or any other implementation): the path table `PATHS` (paths.py) picks per
  call the first of
  - "fa4" (CUDA, compute capability 9.x-11.x, the flash-attn-4 package; fp16/bf16, no padding mask; gradients too):
    two FlashAttention-4 calls, the neighbour band as a sliding window and the grouped keys as a causal call,
    merged by log-sum-exp;
  - "flash-attn" (CUDA, attn_implementation="flash_attention_2", no padding mask, inference): two flash-attn calls,
    the neighbour band as a sliding window and the grouped keys as a causal call, merged by log-sum-exp;
  - "flex" (CUDA, gradients too): two compiled flex_attention calls with region block masks, merged by their
    log-sum-exp (which compiled flex returns on CUDA, not on the CPU);
  - "pieces" (inference without dropout or softcapping): queries in blocks; per block a few flash-attention kernel
    calls (torch's CPU kernel, or CUDA's flash / memory-efficient kernels), each returning the log-sum-exp of its
    scores, merged into one softmax. Contiguous positions (`_pieces`): blocks of slots, the grouped keys every row
    of the block sees in full, the grouped keys at the block's lower edge and the neighbour band (causal calls).
    Positions that skip but never go down along the slots (PoSE, `hfpatch search`'s proxy samples;
    `_pieces_by_position`): blocks of at most PIECE_ROWS queries within W - 1 positions of each other
    (`position_blocks`), the keys each block's queries all see grouped, those they all see as neighbours, the
    block's own keys (causal), and between them the keys that are one or the other by query (fewer than W for
    distinct positions), at both maps with a [block, keys] mask. Memory is O(L) (no [L, L] tensor), and the work
    about that of causal attention;
  - "written-out" (everything else: gradients on the CPU, dropout, softcapping, position ids that go back): the
    explicit path a block of queries at a time (at most 2^24 scores per block).
- "hfpatch_self_extend_eager" (models loaded with attn_implementation="eager"): the explicit path on all queries at
  once, returning the attention weights like eager attention does.
fa4, flash-attn and flex tell the regions apart by the distance in slots, which is the distance in positions when, in
every batch row, position - slot is one constant over the slots the call attends (contiguous positions, left padding
and generate() with a cache included: padded slots, which no query sees, may carry any position). A call whose
positions skip is refused by them (`contiguous_positions`) and goes to the piece path, which cuts its blocks by the
positions where they never go down (`slot_positions`), and to the written-out path where they do (packed documents).
In a torch.compile'd model, whose graph cannot switch paths by tensor values, the piece path cuts by slots too, and a
call whose positions skip stops with an error instead.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...adapters import Adapter
from ...edits import Edits
from ..attention import fa4, flex, kernels, paths, split
from ..attention.paths import AttentionPath
from ..attention.written import explicit_attention
from ..rope.llamacpp import group_attention_flags
from . import rotated

if TYPE_CHECKING:
    from transformers import PreTrainedModel

NAMES = rotated.Names(scheme="self-extend", sdpa="hfpatch_self_extend", eager="hfpatch_self_extend_eager",
                      state="hfpatch_self_extend")
SDPA_NAME, EAGER_NAME, STATE_ATTR = NAMES.sdpa, NAMES.eager, NAMES.state
PIECE_ROWS = 1024  # queries per block on the piece path (fewer for small W: _pieces, position_blocks)
_EVERYTHING_NEAR = 1 << 62  # a window no sequence reaches: the patch-time check
DEFAULT_GROUP_SIZE = 4
DEFAULT_WINDOW_FRACTION = 8
SKIPPING_UNDER_COMPILE = ("position='self-extend' in a torch.compile'd model: these position ids skip, and the paths "
                          "a compiled graph runs cut the keys by the distance of the slots (cutting them by the "
                          "positions branches on their values, which a compiled graph cannot); run this input "
                          "uncompiled")


# ------------------------------------------------------------------------------------------------ the position maps

def grouped_query_positions(pos: torch.Tensor, group_size: int, window: int) -> torch.Tensor:
    return pos // group_size + window - window // group_size


def grouped_key_positions(pos: torch.Tensor, group_size: int) -> torch.Tensor:
    return pos // group_size


def extended_window(trained: int, group_size: int, window: int) -> int:
    """The longest sequence whose grouped positions stay inside the trained window: (trained - W)·G + W."""
    return (trained - window) * group_size + window


@dataclass(frozen=True)
class Maps:
    """What one attention module needs: G, W, and how its model rotates."""

    group_size: int
    window: int
    rotation: rotated.Rotation

    def rotate(self, query: torch.Tensor, key: torch.Tensor, q_pos: torch.Tensor,
               k_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k) rotated at their own positions q_pos [b, q] / k_pos [b, kv] and (q, k) at the grouped ones."""
        G, W, rotate = self.group_size, self.window, self.rotation.rotate
        return (rotate(query, q_pos), rotate(key, k_pos), rotate(query, grouped_query_positions(q_pos, G, W)),
                rotate(key, grouped_key_positions(k_pos, G)))


def positions(query: torch.Tensor, key: torch.Tensor, position_ids: Any,
              attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(query positions [b, q], key positions [b, kv]) of one call (rotated.positions), its cache checked."""
    rotated.check_cache(NAMES.scheme, attention_mask, key, query.shape[2])
    return rotated.positions(position_ids, query.shape[0], query.shape[2], key.shape[2], query.device)


def contiguous_positions(q_pos: torch.Tensor, k_pos: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """Whether every slot distance the call attends is the distance of the positions: in each batch row, position -
    slot is one constant over the key slots some query sees and over the queries of those slots (the queries being
    the last q_len slots). Padded slots are seen by no query, so whatever position they carry (generate() gives them
    0) does not count. What the paths that cut the keys by slot distance (pieces, flex, flash-attn) need."""
    offsets = _offsets(q_pos, k_pos)
    if bool((offsets == offsets[:, :1]).all().item()):  # no skip anywhere, padding included: no mask to read
        return True
    return attention_mask is not None and bool(_one_offset_where_seen(offsets, k_pos.shape[1], attention_mask).item())


def _offsets(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """[b, kv + q]: position - slot of every key slot, then of every query (the last q_len slots)."""
    kv_len = k_pos.shape[1]
    slots = torch.arange(kv_len, device=k_pos.device)
    return torch.cat([k_pos - slots, q_pos - slots[kv_len - q_pos.shape[1]:]], dim=1)


def _one_offset_where_seen(offsets: torch.Tensor, kv_len: int, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """contiguous_positions as a bool tensor, from _offsets: no branch on tensor values, so it traces into a
    compiled graph."""
    if attention_mask is None:
        seen = torch.ones_like(offsets, dtype=torch.bool)
    else:
        keys = _seen_slots(attention_mask, offsets.shape[0], kv_len)
        seen = torch.cat([keys, keys[:, 2 * kv_len - offsets.shape[1]:]], dim=1)  # the queries' slots: the last q_len
    first_seen = offsets.gather(1, seen.int().argmax(dim=1, keepdim=True))  # a row that sees nothing: any offset
    return ((offsets == first_seen) | ~seen).all()


def _seen_slots(attention_mask: torch.Tensor, batch: int, kv_len: int) -> torch.Tensor:
    """[b, kv]: whether some query (of some head) may see the key slot. A float mask counts a slot as seen unless it
    holds the masking value (the dtype's lowest, or -inf)."""
    m = attention_mask[..., :kv_len]
    visible = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
    return visible.any(dim=2).any(dim=1).expand(batch, kv_len)


def slot_positions(q_pos: torch.Tensor, k_pos: torch.Tensor,
                   attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """[b, kv]: the position of every key slot (the queries being the last q_len slots) as the piece path cuts the
    keys by it, when in every batch row the positions never go down along the slots some query sees and each query
    carries its own slot's key position; None otherwise (positions that go back: packed documents, say). Slots seen
    by no query (padding) may carry any position, as for `contiguous_positions`: each takes the position of the last
    seen slot before it (of the first seen slot, before that), which keeps the row non-decreasing."""
    batch, kv_len = k_pos.shape[0], k_pos.shape[1]
    seen = (torch.ones(batch, kv_len, dtype=torch.bool, device=k_pos.device) if attention_mask is None
            else _seen_slots(attention_mask, batch, kv_len))
    lowest = torch.iinfo(k_pos.dtype).min
    running = torch.where(seen, k_pos, lowest).cummax(dim=1).values
    ok = ((running == k_pos) | ~seen).all()
    if q_pos.shape[1] != kv_len:  # with a cache the keys' positions are inferred: they must meet the queries'
        first = kv_len - q_pos.shape[1]
        ok = ok & ((q_pos == k_pos[:, first:]) | ~seen[:, first:]).all()
    if not bool(ok.item()):
        return None
    first_seen = k_pos.gather(1, seen.int().argmax(dim=1, keepdim=True))
    return torch.where(running == lowest, first_seen, running)


# ------------------------------------------------------------------------------------------------------ piece path

def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool, scaling: float,
            flip: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp of the scores) of one piece by a flash-attention kernel (kernels.attend: GQA as given,
    causal = top-left aligned). flip: rows and keys in reverse order, which turns the upper triangle into the
    lower one the kernel skips to."""
    if flip:
        q, k, v = q.flip(2), k.flip(2), v.flip(2)
        mask = None if mask is None else mask.flip(2, 3)
    out, lse = kernels.attend(q, k, v, scaling, mask=mask, causal=causal)
    return (out.flip(2), lse.flip(-1)) if flip else (out, lse)


def _pieces(qn: torch.Tensor, kn: torch.Tensor, qg: torch.Tensor, kg: torch.Tensor, v: torch.Tensor,
            attention_mask: torch.Tensor | None, window: int, scaling: float) -> torch.Tensor:
    """Self-Extend attention over blocks of B <= W - 1 query slots [s, e) (the queries are the last q_len key slots),
    five pieces per block, each a causal or unmasked kernel call, merged by log-sum-exp:
      neighbour keys (i - W < j <= i): [s, e) causal; [s - W + 1, e - W + 1) where j >= i - W + 1, causal once
      rows and keys are reversed; [e - W + 1, s) in full (empty when B = W - 1);
      grouped keys (j <= i - W), rows i >= W only: [max(s, W) - W, e - W) causal; [0, max(s, W) - W) in full."""
    q_len, kv_len = qn.shape[2], kn.shape[2]
    first = kv_len - q_len
    rows_per_block = max(1, min(PIECE_ROWS, window - 1))
    outs = []
    for s in range(first, kv_len, rows_per_block):
        e = min(kv_len, s + rows_per_block)
        r = slice(s - first, e - first)

        def piece(q: Any, k: torch.Tensor, lo: int, hi: int, rows: slice = slice(None), causal: bool = False,
                  flip: bool = False, r: slice = r) -> tuple[torch.Tensor, torch.Tensor]:  # r: this block's query rows
            m = None if attention_mask is None else split.additive(attention_mask[:, :, r][:, :, rows, lo:hi], q.dtype)
            return _attend(q[:, :, r][:, :, rows], k[:, :, lo:hi], v[:, :, lo:hi], m, causal, scaling, flip)

        out, lse = piece(qn, kn, s, e, causal=True)
        acc = out.float()
        low, high = max(0, s - window + 1), min(s, e - window + 1)  # high < e - W + 1 only when W = 1 (no keys)
        parts = [(slice(None), piece(qn, kn, low, high, causal=True, flip=True)) if high > low else None]
        if s > max(0, e - window + 1):
            parts.append((slice(None), piece(qn, kn, max(0, e - window + 1), s)))
        g = max(s, window)  # the first row with grouped keys
        if e > g:
            rows = slice(g - s, None)
            parts.append((rows, piece(qg, kg, g - window, e - window, rows, causal=True)))
            if g > window:
                parts.append((rows, piece(qg, kg, 0, g - window, rows)))
        for rows, (o, lse_o) in filter(None, parts):
            acc[:, :, rows], lse[..., rows] = kernels.merge(acc[:, :, rows], lse[..., rows], o, lse_o)
        outs.append(acc.to(v.dtype))
    return torch.cat(outs, dim=2)


def _same_rows(t: torch.Tensor) -> bool:
    return bool((t == t[:1]).all().item())


def _pieces_by_position(qn: torch.Tensor, kn: torch.Tensor, qg: torch.Tensor, kg: torch.Tensor, v: torch.Tensor,
                        attention_mask: torch.Tensor | None, slot_pos: torch.Tensor, window: int,
                        scaling: float) -> torch.Tensor:
    """Self-Extend attention [b, H, q, d] in v's dtype where the positions skip but never go down along the slots
    (slot_pos [b, kv]: slot_positions): the whole batch at once where its rows share their positions, else one row
    at a time (padding that shifts the positions of a row)."""
    rows = [slice(None)] if _same_rows(slot_pos) else [slice(i, i + 1) for i in range(v.shape[0])]
    outs = [_position_pieces(qn[b], kn[b], qg[b], kg[b], v[b], _batch_rows(attention_mask, b), slot_pos[b][0],
                             window, scaling) for b in rows]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def _batch_rows(attention_mask: torch.Tensor | None, batch: slice) -> torch.Tensor | None:
    """The model's mask for the batch rows `batch` (a mask of one row serves every row)."""
    return attention_mask if attention_mask is None or attention_mask.shape[0] == 1 else attention_mask[batch]


def position_blocks(pos: list[int], q_len: int, window: int) -> Iterator[tuple[int, int, int, int]]:
    """(s, e, a, c) per block of query slots [s, e) (the queries being the last q_len of the key slots, whose
    positions `pos` never go down): at most PIECE_ROWS queries whose positions lie within window - 1 of the first
    one's, so that the block's own keys are neighbours of each of its queries. Keys [0, a) (position <= pos[s] - W)
    are grouped for every query of the block, keys [c, s) (position > pos[e - 1] - W) neighbours of every one, and
    keys [a, c) one or the other by query."""
    s, kv_len = len(pos) - q_len, len(pos)
    while s < kv_len:
        e = min(kv_len, s + PIECE_ROWS, bisect_right(pos, pos[s] + window - 1, s))
        a = bisect_right(pos, pos[s] - window, 0, s)
        yield s, e, a, bisect_right(pos, pos[e - 1] - window, a, s)
        s = e


def _position_pieces(qn: torch.Tensor, kn: torch.Tensor, qg: torch.Tensor, kg: torch.Tensor, v: torch.Tensor,
                     attention_mask: torch.Tensor | None, pos: torch.Tensor, window: int,
                     scaling: float) -> torch.Tensor:
    """Self-Extend attention for batch rows that share their key slots' positions `pos` [kv], per block of
    queries (position_blocks) up to five kernel calls merged by log-sum-exp: the block's own keys [s, e) causal at
    the neighbour maps; [c, s) in full at the neighbour maps; [0, a) in full at the grouped maps; and [a, c) at both
    maps, each with a [block, c - a] mask of the pairs whose distance of positions is below W (neighbour) or not
    (grouped)."""
    q_len, kv_len = qn.shape[2], kn.shape[2]
    first = kv_len - q_len
    positions = pos.tolist()
    outs = []
    for s, e, a, c in position_blocks(positions, q_len, window):
        r = slice(s - first, e - first)

        def piece(q: torch.Tensor, k: torch.Tensor, lo: int, hi: int, causal: bool = False,
                  near: torch.Tensor | None = None,
                  r: slice = r) -> tuple[torch.Tensor, torch.Tensor]:  # r: this block's query rows
            given = None if attention_mask is None else attention_mask[:, :, r, lo:hi]
            m = _piece_mask(near, given, q.dtype)
            return kernels.attend(q[:, :, r], k[:, :, lo:hi], v[:, :, lo:hi], scaling, mask=m, causal=causal)

        parts = [piece(qn, kn, s, e, causal=True)]
        if c < s:
            parts.append(piece(qn, kn, c, s))
        if a < c:
            near = pos[None, a:c] > pos[s:e, None] - window
            parts += [piece(qn, kn, a, c, near=near), piece(qg, kg, a, c, near=~near)]
        if a > 0:
            parts.append(piece(qg, kg, 0, a))
        outs.append(kernels.merge_parts(parts)[0].to(v.dtype))
    return torch.cat(outs, dim=2)


def _piece_mask(keep: torch.Tensor | None, given: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """An additive [1 or b, 1 or H, rows, keys] mask of `dtype`: 0 where `keep` [rows, keys] holds (None: every
    pair) and the model's mask `given` (bool, or additive; None: no padding) lets the query see the key, else the
    dtype's lowest value; None when neither limits the piece."""
    if keep is None:
        return None if given is None else split.additive(given, dtype)
    lowest = torch.finfo(dtype).min
    m = torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, lowest)[None, None]
    if given is None:
        return m
    return torch.where(given, m, lowest) if given.dtype == torch.bool else (m + given.to(dtype)).clamp(min=lowest)


# ------------------------------------------------------------------------------------------- attention functions

def _explicit(maps: Maps, q_pos: torch.Tensor, k_pos: torch.Tensor, qn: torch.Tensor, kn: torch.Tensor,
              qg: torch.Tensor, kg: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
              scaling: float, dropout: float, training: bool, softcap: float | None,
              block: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The scores at both maps written out, each (query, key) pair taking the neighbour one where the distance of
    their positions (q_pos [b, q], k_pos [b, kv]) is below the window; slots only order the keys (causality)."""
    kv_len = kn.shape[2]
    slots = torch.arange(kv_len, device=qn.device)
    q_slots = slots[kv_len - qn.shape[2]:]
    groups = qn.shape[1] // kn.shape[1]
    kn, kg, value = (t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in (kn, kg, value))

    def scores(s: int, e: int) -> tuple[torch.Tensor, None]:
        near = (q_pos[:, None, s:e, None] - k_pos[:, None, None, :]) < maps.window
        return torch.where(near, qn[:, :, s:e] @ kn.transpose(2, 3), qg[:, :, s:e] @ kg.transpose(2, 3)) * scaling, None

    return explicit_attention(scores, value, attention_mask, q_slots, slots, softcap=softcap, dropout=dropout,
                              training=training, block=block)


def self_extend_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return paths.run("self-extend", module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                     causal=True, kwargs=kwargs)


def _both(module: nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
          kwargs: dict[str, Any]) -> tuple[Maps, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                           torch.Tensor]:
    """(maps, q positions, k positions, qn, kn, qg, kg) of one call."""
    maps: Maps = getattr(module, STATE_ATTR)
    q_pos, k_pos = positions(query, key, kwargs.get("position_ids"), attention_mask)
    return (maps, q_pos, k_pos, *maps.rotate(query, key, q_pos, k_pos))


def _both_by_slots(module: nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
                   kwargs: dict[str, Any]) -> tuple[Maps, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(maps, qn, kn, qg, kg) for a path that tells the regions apart by slot distance; PathUnavailable (before
    anything is rotated) when the call's positions skip, so that the written-out path takes it. A compiled graph
    cannot choose its path by tensor values: there the call stays on this path, and positions that skip stop it with
    an error (SKIPPING_UNDER_COMPILE)."""
    maps: Maps = getattr(module, STATE_ATTR)
    q_pos, k_pos = positions(query, key, kwargs.get("position_ids"), attention_mask)
    if torch.compiler.is_compiling():
        ok = _one_offset_where_seen(_offsets(q_pos, k_pos), k_pos.shape[1], attention_mask)
        torch._assert_async(ok, SKIPPING_UNDER_COMPILE)
    elif not contiguous_positions(q_pos, k_pos, attention_mask):
        raise paths.PathUnavailable("position ids that skip: the neighbour window is a distance of positions, not "
                                    "of slots; the written-out path takes this call")
    return (maps, *maps.rotate(query, key, q_pos, k_pos))


def _run_pieces(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, *, scaling: float, dropout: float, causal: bool,
                softcap: float | None, kwargs: dict[str, Any]) -> torch.Tensor:
    """Contiguous positions: blocks cut by slot distance (_pieces). Positions that skip but never go down along the
    slots: blocks cut by the positions (_pieces_by_position). Positions that go back: PathUnavailable, the
    written-out path takes the call. A compiled graph stays on _pieces (_both_by_slots)."""
    if torch.compiler.is_compiling():
        maps, qn, kn, qg, kg = _both_by_slots(module, query, key, attention_mask, kwargs)
        return _pieces(qn, kn, qg, kg, value, attention_mask, maps.window, scaling).transpose(1, 2).contiguous()
    maps = getattr(module, STATE_ATTR)
    q_pos, k_pos = positions(query, key, kwargs.get("position_ids"), attention_mask)
    slot_pos = None
    if not contiguous_positions(q_pos, k_pos, attention_mask):
        slot_pos = slot_positions(q_pos, k_pos, attention_mask)
        if slot_pos is None:
            raise paths.PathUnavailable("position ids that go back along the slots (or queries whose positions are "
                                        "not their cached keys'): the written-out path takes this call")
    qn, kn, qg, kg = maps.rotate(query, key, q_pos, k_pos)
    if slot_pos is None:
        out = _pieces(qn, kn, qg, kg, value, attention_mask, maps.window, scaling)
    else:
        out = _pieces_by_position(qn, kn, qg, kg, value, attention_mask, slot_pos, maps.window, scaling)
    return out.transpose(1, 2).contiguous()


def _run_flex(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, *, scaling: float, dropout: float, causal: bool,
              softcap: float | None, kwargs: dict[str, Any]) -> torch.Tensor:
    maps, qn, kn, qg, kg = _both_by_slots(module, query, key, attention_mask, kwargs)
    out = split.two_maps_flex(qn, kn, qg, kg, value, attention_mask, maps.window, scaling, softcap)
    return out.transpose(1, 2).contiguous()


def _run_flash(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, *, scaling: float, dropout: float, causal: bool,
               softcap: float | None, kwargs: dict[str, Any]) -> torch.Tensor:
    maps, qn, kn, qg, kg = _both_by_slots(module, query, key, attention_mask, kwargs)
    return split.two_maps_flash(qn, kn, qg, kg, value, maps.window, scaling, softcap)


def _run_fa4(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, *, scaling: float, dropout: float, causal: bool,
             softcap: float | None, kwargs: dict[str, Any]) -> torch.Tensor:
    fa4.require_plain_causal(attention_mask, query.shape[2], key.shape[2])
    maps, qn, kn, qg, kg = _both_by_slots(module, query, key, attention_mask, kwargs)
    return split.two_maps_fa4(qn, kn, qg, kg, value, maps.window, scaling, softcap)


def _run_written_out(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, *, scaling: float, dropout: float, causal: bool,
                     softcap: float | None, kwargs: dict[str, Any]) -> torch.Tensor:
    maps, q_pos, k_pos, qn, kn, qg, kg = _both(module, query, key, attention_mask, kwargs)
    out, _ = _explicit(maps, q_pos, k_pos, qn, kn, qg, kg, value, attention_mask, scaling, dropout, module.training,
                       softcap, block=True)
    return out


PATHS = (
    AttentionPath("fa4", _run_fa4, "two FlashAttention-4 calls (neighbour window, grouped keys) merged by log-sum-exp "
                  "(Hopper, Blackwell)", devices=frozenset({"cuda"}), dtypes=paths.LOW, softcap=True,
                  masks=frozenset({"none", "bool"}), missing=fa4.missing),
    AttentionPath("flash-attn", _run_flash, "two flash-attn calls (neighbour window, grouped keys) merged by "
                  "log-sum-exp (attn_implementation='flash_attention_2')", devices=frozenset({"cuda"}),
                  grad_devices=frozenset(), dtypes=paths.LOW, softcap=True, masks=frozenset({"none"}),
                  base=frozenset({"flash_attention_2"}), missing=kernels.flash_attn_missing),
    AttentionPath("flex", _run_flex, "two compiled flex_attention calls (neighbour band, grouped keys) merged by their "
                  "log-sum-exp", devices=frozenset({"cuda"}), softcap=True, masks=frozenset({"none", "bool"}),
                  worth=flex.worth_it),
    AttentionPath("pieces", _run_pieces, "blocks of queries, each a few flash-attention kernel calls merged by "
                  "log-sum-exp", grad_devices=frozenset()),
    AttentionPath("written-out", _run_written_out, "scores written out at both position maps, a block of queries at "
                  "a time", dropout=True, softcap=True),
)


def self_extend_eager(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    paths.record(module, "eager")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    maps, q_pos, k_pos, qn, kn, qg, kg = _both(module, query, key, attention_mask, kwargs)
    return _explicit(maps, q_pos, k_pos, qn, kn, qg, kg, value, attention_mask, scaling, dropout, module.training,
                     kwargs.get("softcap"), block=False)


rotated.register(NAMES, self_extend_sdpa, self_extend_eager)


# ---------------------------------------------------------------------------------------------------------- apply

def default_settings(trained: int) -> tuple[int, int]:
    """(G, W) for `position="self-extend"` given no options: DEFAULT_GROUP_SIZE, and W the trained window divided by
    DEFAULT_WINDOW_FRACTION (the rule the passkey grid on SmolLM2 supports: docs/studies/self-extend.md)."""
    return DEFAULT_GROUP_SIZE, max(1, trained // DEFAULT_WINDOW_FRACTION)


def apply_self_extend(model: PreTrainedModel, adapter: Adapter, req: dict, scheme: Any, edits: Edits) -> dict:
    targets, trained = rotated.rotations(model, adapter, NAMES.scheme)
    default_g, default_w = default_settings(trained)
    G, W = req.get("group_size", default_g), req.get("window", default_w)
    if trained < W:
        raise ValueError(f"window={W} is beyond the {trained} tokens {adapter.model_type} was trained on; "
                         f"Self-Extend keeps exact positions only inside the window, so window must be <= {trained}")
    states = [(attn, Maps(G, W, rotation)) for attn, rotation in targets]
    # with every key inside the window, the model must be itself again
    rotated.install(model, adapter, NAMES, states, lambda m: dataclasses.replace(m, window=_EVERYTHING_NEAR), edits)
    edits.set(model.config.get_text_config(), "max_position_embeddings", extended_window(trained, G, W))
    return {"group_size": G, "window": W}


def llamacpp_refusal(req: dict, trained: int) -> str:
    """Why a GGUF cannot carry Self-Extend, naming llama.cpp's flags for the settings `patch` would use (`req`, and
    the defaults of a `trained`-token window for what it leaves out)."""
    default_g, default_w = default_settings(trained)
    g, w = req.get("group_size", default_g), req.get("window", default_w)
    flags = group_attention_flags(g, w)
    # the values hfpatch.patch would choose for options left out, named so that llama.cpp runs the same model
    left_out = [f"G = {g}" if key == "group_size" else f"W = {w}" for key in ("group_size", "window") if key not in req]
    defaults = (f" ({' and '.join(left_out)}: hfpatch's default{'s' if len(left_out) > 1 else ''} for this model's "
                f"{trained}-token trained window)" if left_out else "")
    multiple = "" if w % g == 0 else (f" (llama.cpp needs the width to be a multiple of the group size: e.g. "
                                      f"{group_attention_flags(g, max(g, w // g * g))})")
    return (f"llama.cpp applies Self-Extend at run time, not from metadata: run the unchanged GGUF with {flags}"
            f"{defaults}{multiple} in llama-completion or llama-passkey (llama-cli in older builds); llama-server no "
            "longer has group attention")
