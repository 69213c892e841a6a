"""Dual Chunk Attention (An et al., 2024, "Training-Free Long-Context Scaling of Large Language Models").

The sequence is cut into chunks of s = chunk_size - local_window positions, and every key is rotated at its position
inside its chunk, p_j mod s. The query is rotated at one of three positions, depending on where the key is:
- intra-chunk (the key in the query's chunk): p_i mod s, so the distance is the true one, below s;
- successive-chunk (the key in the chunk just before): s + (p_i mod s) for the first local_window queries of a chunk,
  which keeps their distances to the previous chunk's last keys exact, and chunk_size - 1 for the others;
- inter-chunk (the key further back): chunk_size - 1.
One softmax runs over the three kinds of keys. No distance ever exceeds chunk_size - 1, whatever the length: with
chunk_size at most the trained window, every position the model sees is one it was trained on. Chunks are counted
from position 0, by the positions the model is given.

The defaults follow the paper's reference implementation: chunk_size = 3/4 of the trained window, local_window =
1/16 of it (so chunks of 11/16 of the window). The paper writes the successive and inter-chunk query position as
c - 1 with c the trained window; here it is chunk_size - 1, which is the paper's formula when chunk_size = c and
keeps every distance below chunk_size otherwise. With chunks at least as long as the sequence, only the intra-chunk
positions occur, and they are the model's own: the unpatched model.

Queries and keys are rotated by the attention function itself (rotated.py), the KV cache holding un-rotated keys.
Attention functions registered with transformers (each with its mask function):
- "hfpatch_dual_chunk" (models on sdpa or any other implementation): the path table `PATHS` (paths.py) picks per
  call the first of
  - "fa4" (CUDA, compute capability 9.x-11.x, the flash-attn-4 package; fp16/bf16, no padding; gradients too): the
    pieces below as FlashAttention-4 calls;
  - "pieces" (no dropout or softcapping; training too): per chunk of queries up to four flash-attention kernel
    calls (torch's CPU kernel, or CUDA's flash / memory-efficient kernels), each returning the log-sum-exp of its
    scores — the chunk's own keys (causal, plus in full those cached before the first query), the previous chunk's
    keys, the keys before that — merged into one softmax (attention/pieces.py). Memory is O(L), the work about that
    of causal attention; the backward runs each call's kernel backward with the merged output and log-sum-exp;
  - "written-out" (everything else: dropout, softcapping): the scores at the three query positions written out, a
    block of queries at a time.
- "hfpatch_dual_chunk_eager" (models loaded with attn_implementation="eager"): the written-out path on all queries at
  once, returning the attention weights like eager attention does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...adapters import Adapter
from ...edits import Edits
from ..attention import fa4, kernels, paths, pieces, split
from ..attention.paths import AttentionPath
from ..attention.slots import positions
from ..attention.written import explicit_attention
from . import rotated

if TYPE_CHECKING:
    from transformers import PreTrainedModel

NAMES = rotated.Names(scheme="dual-chunk", sdpa="hfpatch_dual_chunk", eager="hfpatch_dual_chunk_eager",
                      state="hfpatch_dual_chunk")
_ONE_CHUNK = 1 << 62  # a chunk no sequence fills: the patch-time check


# ------------------------------------------------------------------------------------------------ the position maps

def default_chunk_size(trained: int) -> int:
    return trained * 3 // 4


def default_local_window(trained: int) -> int:
    return max(1, trained // 16)


def key_positions(pos: torch.Tensor, chunk: int) -> torch.Tensor:
    return pos % chunk


def intra_query_positions(pos: torch.Tensor, chunk: int) -> torch.Tensor:
    return pos % chunk


def successive_query_positions(pos: torch.Tensor, chunk: int, chunk_size: int) -> torch.Tensor:
    return (pos % chunk + chunk).clamp(max=chunk_size - 1)


def inter_query_positions(pos: torch.Tensor, chunk_size: int) -> torch.Tensor:
    return torch.full_like(pos, chunk_size - 1)


@dataclass(frozen=True)
class Maps:
    """The queries at their three positions, the keys at theirs, and the chunk of every query and key ([b, n])."""

    intra: torch.Tensor
    successive: torch.Tensor | None  # None when no query has a key in an earlier chunk
    inter: torch.Tensor | None
    key: torch.Tensor
    q_chunk: torch.Tensor
    k_chunk: torch.Tensor


@dataclass(frozen=True)
class Chunks:
    """What one attention module needs: chunk_size, local_window, and how its model rotates."""

    chunk_size: int
    local_window: int
    rotation: rotated.Rotation

    @property
    def length(self) -> int:
        """Positions per chunk."""
        return self.chunk_size - self.local_window

    def maps(self, query: torch.Tensor, key: torch.Tensor, position_ids: torch.Tensor,
             attention_mask: torch.Tensor | None) -> Maps:
        rotated.check_cache(NAMES.scheme, attention_mask, key, query.shape[2])
        q_pos, k_pos = positions(position_ids, query.shape[0], query.shape[2], key.shape[2], query.device)
        s, C, rotate = self.length, self.chunk_size, self.rotation.rotate
        q_chunk, k_chunk = q_pos.div(s, rounding_mode="floor"), k_pos.div(s, rounding_mode="floor")
        earlier = bool((q_chunk.max() > k_chunk.min()).item())
        return Maps(rotate(query, intra_query_positions(q_pos, s)),
                    rotate(query, successive_query_positions(q_pos, s, C)) if earlier else None,
                    rotate(query, inter_query_positions(q_pos, C)) if earlier else None,
                    rotate(key, key_positions(k_pos, s)), q_chunk, k_chunk)


# ------------------------------------------------------------------------------------------------------ piece path

def _same_rows(t: torch.Tensor) -> bool:
    return bool((t == t[:1]).all().item())


INTRA, SUCCESSIVE, INTER = 0, 1, 2  # the query tensors of the pieces


def _chunk_pieces(m: Maps, attention_mask: torch.Tensor | None, batch: slice,
                  dtype: torch.dtype) -> Iterator[pieces.Piece]:
    """Dual chunk attention's pieces for the batch rows `batch`, whose chunks agree (m.q_chunk / m.k_chunk rows
    equal): per chunk n of the queries (slots [t0, t1), the last q_len of the key slots), up to four kernel calls —
    keys of chunk n: [t0, t1) causal and [a, t0) in full; chunk n - 1: [p, a); earlier chunks: [0, p)."""
    q_len, kv_len = m.intra.shape[2], m.key.shape[2]
    first = kv_len - q_len
    q_chunk, k_chunk = m.q_chunk[batch][0].contiguous(), m.k_chunk[batch][0].contiguous()
    for n in torch.unique_consecutive(q_chunk).tolist():
        r0, r1 = (int(torch.searchsorted(q_chunk, v)) for v in (n, n + 1))
        t0, t1 = first + r0, first + r1
        a, p = (int(torch.searchsorted(k_chunk, v)) for v in (n, n - 1))

        def piece(query: int, lo: int, hi: int, causal: bool = False, r0: int = r0, r1: int = r1) -> pieces.Piece:
            mask = None if attention_mask is None else split.additive(attention_mask[batch, :, r0:r1, lo:hi], dtype)
            return pieces.Piece(query, slice(r0, r1), slice(lo, hi), causal, mask, batch)

        yield piece(INTRA, t0, t1, causal=True)
        if a < t0:  # cached keys of this chunk, before its first query
            yield piece(INTRA, a, t0)
        if p < a:
            yield piece(SUCCESSIVE, p, a)
        if p > 0:
            yield piece(INTER, 0, p)


def _pieces(m: Maps, value: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Dual chunk attention [b, H, q, d] in value's dtype by its pieces (pieces.attention: gradients included): the
    whole batch at once where its rows share their chunks, else one row at a time (padding with positions that
    count real tokens)."""
    shared = _same_rows(m.q_chunk) and _same_rows(m.k_chunk)
    rows = [slice(None)] if shared else [slice(i, i + 1) for i in range(value.shape[0])]
    queries = [t for t in (m.intra, m.successive, m.inter) if t is not None]  # both or neither of the last two

    def made() -> Iterator[pieces.Piece]:
        for batch in rows:
            yield from _chunk_pieces(m, attention_mask, batch, m.intra.dtype)

    return pieces.attention(queries, m.key, value, made, scaling)[0]


def _monotonic(m: Maps) -> bool:
    """Chunks that never go down along the slots: what the piece path's ranges assume (true of the positions
    transformers and generate() make, padded or not)."""
    return bool((m.q_chunk.diff(dim=-1) >= 0).all().item() and (m.k_chunk.diff(dim=-1) >= 0).all().item())


# ------------------------------------------------------------------------------------------- attention functions

def _explicit(m: Maps, value: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float, dropout: float,
              training: bool, softcap: float | None, block: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    q_len, kv_len = m.intra.shape[2], m.key.shape[2]
    slots = torch.arange(kv_len, device=value.device)
    groups = m.intra.shape[1] // m.key.shape[1]
    key, value = (t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in (m.key, value))
    kt = key.transpose(2, 3)

    def scores(s: int, e: int) -> tuple[torch.Tensor, None]:
        x = m.intra[:, :, s:e] @ kt
        if m.successive is not None and m.inter is not None:
            qc, kc = m.q_chunk[:, None, s:e, None], m.k_chunk[:, None, None, :]
            x = torch.where(kc == qc, x, torch.where(kc == qc - 1, m.successive[:, :, s:e] @ kt,
                                                     m.inter[:, :, s:e] @ kt))
        return x * scaling, None

    return explicit_attention(scores, value, attention_mask, slots[kv_len - q_len:], slots, softcap=softcap,
                              dropout=dropout, training=training, block=block)


def _maps(module: nn.Module, query: Any, key: Any, attention_mask: Any, kwargs: Any) -> Maps:
    chunks: Chunks = getattr(module, NAMES.state)
    return chunks.maps(query, key, kwargs.get("position_ids"), attention_mask)


def _run_pieces(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, *, scaling: float, dropout: float, causal: bool,
                softcap: float | None, kwargs: dict[str, Any]) -> torch.Tensor:
    m = _maps(module, query, key, attention_mask, kwargs)
    if not _monotonic(m):
        raise paths.PathUnavailable("position ids that go back: the written-out path takes this call")
    return _pieces(m, value, attention_mask, scaling).transpose(1, 2).contiguous()


def _run_fa4(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, *, scaling: float, dropout: float, causal: bool,
             softcap: float | None, kwargs: dict[str, Any]) -> torch.Tensor:
    """The pieces as FlashAttention-4 calls (no padding: every row shares its chunks), merged by their log-sum-exp
    with torch ops, so that gradients pass through FA4's own backward (which takes the log-sum-exp's gradient)."""
    fa4.require_plain_causal(attention_mask, query.shape[2], key.shape[2])
    m = _maps(module, query, key, attention_mask, kwargs)
    if not (_monotonic(m) and _same_rows(m.q_chunk) and _same_rows(m.k_chunk)):
        raise paths.PathUnavailable("position ids that go back or differ between the rows")
    queries = [t for t in (m.intra, m.successive, m.inter) if t is not None]
    outs: list[torch.Tensor] = []
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []
    rows = None
    for p in _chunk_pieces(m, None, slice(None), query.dtype):
        if rows is not None and p.rows != rows:  # a new chunk of queries: merge the last one's parts
            outs.append(kernels.merge_parts(parts)[0])
            parts = []
        rows = p.rows
        parts.append(fa4.attend(queries[p.query][:, :, p.rows], m.key[:, :, p.keys], value[:, :, p.keys], scaling,
                                causal=p.causal, softcap=softcap))
    outs.append(kernels.merge_parts(parts)[0])
    return torch.cat(outs, dim=2).to(value.dtype).transpose(1, 2).contiguous()


def _run_written_out(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, *, scaling: float, dropout: float, causal: bool,
                     softcap: float | None, kwargs: dict[str, Any]) -> torch.Tensor:
    m = _maps(module, query, key, attention_mask, kwargs)
    return _explicit(m, value, attention_mask, scaling, dropout, module.training, softcap, block=True)[0]


PATHS = (
    AttentionPath("fa4", _run_fa4, "per chunk of queries a few FlashAttention-4 calls merged by log-sum-exp (Hopper, "
                  "Blackwell)", devices=frozenset({"cuda"}), dtypes=paths.LOW, softcap=True,
                  masks=frozenset({"none", "bool"}), missing=fa4.missing),
    AttentionPath("pieces", _run_pieces, "per chunk of queries a few flash-attention kernel calls (own chunk, "
                  "previous chunk, earlier chunks) merged by log-sum-exp; gradients by each call's kernel backward"),
    AttentionPath("written-out", _run_written_out, "scores written out at the three query positions, a block of "
                  "queries at a time", dropout=True, softcap=True),
)


def dual_chunk_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return paths.run(NAMES.scheme, module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                     causal=True, kwargs=kwargs)


def dual_chunk_eager(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    paths.record(module, "eager")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    m = _maps(module, query, key, attention_mask, kwargs)
    return _explicit(m, value, attention_mask, scaling, dropout, module.training, kwargs.get("softcap"), block=False)


rotated.register(NAMES, dual_chunk_sdpa, dual_chunk_eager)


# ---------------------------------------------------------------------------------------------------------- apply

def settings(req: dict, trained: int, model_type: str) -> tuple[int, int]:
    """(chunk_size, local_window): the request's, or the defaults from the trained window; ValueError when they
    cannot work."""
    chunk_size = req.get("chunk_size", default_chunk_size(trained))
    local_window = req.get("local_window", default_local_window(trained))
    if chunk_size > trained:
        raise ValueError(f"chunk_size={chunk_size} is beyond the {trained} tokens {model_type} was trained on; query "
                         f"positions go up to chunk_size - 1, so chunk_size must be <= {trained} (default "
                         f"{default_chunk_size(trained)})")
    if local_window >= chunk_size:
        raise ValueError(f"local_window={local_window} must be smaller than chunk_size={chunk_size}: chunks are "
                         "chunk_size - local_window tokens long")
    return chunk_size, local_window


def apply_dual_chunk(model: PreTrainedModel, adapter: Adapter, req: dict, scheme: Any, edits: Edits) -> dict:
    targets, trained = rotated.rotations(model, adapter, NAMES.scheme)
    chunk_size, local_window = settings(req, trained, adapter.model_type)
    states = [(attn, Chunks(chunk_size, local_window, rotation)) for attn, rotation in targets]
    # one chunk longer than any sequence: the model's own positions, so it must be itself again
    rotated.install(model, adapter, NAMES, states, lambda c: dataclasses.replace(c, chunk_size=_ONE_CHUNK), edits)
    return {"chunk_size": chunk_size, "local_window": local_window}
