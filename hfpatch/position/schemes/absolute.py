"""Absolute position signals: the sinusoidal table, keeping a removed rotation removed through a reload, and
interpolating a learned position table (position="interpolate").

Learned tables (GPT-2's wpe, OPT's embed_positions, BERT's position_embeddings) are nn.Embedding lookups by position
(OPT adds an offset of 2 first). A mixin placed just above nn.Embedding in the table's class replaces the lookup:
zeros (adapters/positions.ZeroPositions: the model no longer adds positions) or the sinusoidal rows
(SinusoidalPositions, here). The table's weight stays, unused, so the
checkpoint layout does not change. RoPE models get the sinusoidal table added to the input of their first block
(the decoder passes it `position_ids`, which are right with a KV cache too).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ...utils.host import available_bytes


def sinusoidal_table(positions: torch.Tensor, dim: int, base: float = 10000.0) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / base^(2i/d)), PE(pos, 2i+1) = cos(pos / base^(2i/d)) (Vaswani et al., 2017).
    positions: any shape; returns [..., dim] in float32."""
    i = torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device)
    angle = positions.to(torch.float64)[..., None] / base ** (i / dim)
    pe = torch.zeros(*positions.shape, dim, dtype=torch.float64, device=positions.device)
    pe[..., 0::2] = torch.sin(angle)
    pe[..., 1::2] = torch.cos(angle[..., : dim // 2])
    return pe.float()


def check_table_fits(rows: int, dim: int, like: torch.Tensor, what: str, working: int = 0) -> None:
    """Refuse, before allocating it, a position table of rows x dim (in `like`'s dtype, on its device) that the
    device has no room for, `working` float64 copies of it included (what building it needs on the way); an
    allocator error from deep inside torch would not say which option asked for it."""
    need = rows * dim * (like.element_size() + 8 * working)
    free = free_bytes(like.device)
    if free is not None and need > free:
        raise ValueError(f"{what} makes a position table of {rows:,} rows x {dim}, which needs {need / 2**30:.3g} GiB "
                         f"while {like.device} has {free / 2**30:.3g} GiB free: ask for a smaller table")


def free_bytes(device: torch.device) -> int | None:
    """Bytes free on `device` (a CUDA device, or the host's available memory); None when it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device.index or 0)[0]
    return available_bytes() if device.type == "cpu" else None


def interpolate_rows(table: torch.Tensor, factor: float, keep: int = 0) -> torch.Tensor:
    """Position interpolation for a learned table (Chen et al., 2023, applied to the table instead of RoPE): row p'
    of the new table, p' < ceil(factor·N), is the old table at p'/factor, linearly interpolated (clamped at the last
    row). The first `keep` rows (OPT's offset rows) are copied as they are."""
    head, body = table[:keep], table[keep:].double()
    n = body.shape[0]
    new_n = math.ceil(n * factor)
    x = torch.arange(new_n, dtype=torch.float64, device=table.device) / factor
    lo = x.floor().clamp(max=n - 1).long()
    hi = (lo + 1).clamp(max=n - 1)
    w = (x - lo.double()).clamp(0, 1)[:, None]
    rows = (1 - w) * body[lo] + w * body[hi]
    return torch.cat([head, rows.to(table.dtype)], dim=0)


class NoRotation:
    """Mixed into a rotary module made the identity (adapters.positions.make_identity) by a patch whose weights are
    saved: reloading such a model goes through transformers' loader, which recomputes a rotary module's
    (non-persistent) inverse frequencies from its config; they are zeroed again, in place, before the first forward
    that finds them changed (so cos = 1, sin = 0 whatever form the module returns them in)."""

    def forward(self, *args, **kwargs):
        for name, buffer in self.named_buffers(recurse=False):
            if name.endswith("inv_freq") and bool(buffer.any()):
                buffer.zero_()
        return super().forward(*args, **kwargs)


SCALE_ATTR = "hfpatch_pe_scale"  # position="sinusoidal", pe_scale=: the table's amplitude (1: the paper's ±1)


class SinusoidalPositions(nn.Embedding):
    """The table lookup returns the sinusoidal encoding of the position (index minus the table's offset), times
    pe_scale."""

    hfpatch_offset: int = 0
    hfpatch_pe_scale: float = 1.0

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # `input`: nn.Embedding's own parameter name
        pe = sinusoidal_table(input - self.hfpatch_offset, self.embedding_dim) * self.hfpatch_pe_scale
        return pe.to(device=self.weight.device, dtype=self.weight.dtype)


class SinusoidalInput:
    """Mixed into the first block of a RoPE model: adds the sinusoidal table at `position_ids`, times pe_scale, to
    its input."""

    hfpatch_pe_scale: float = 1.0

    def forward(self, hidden_states, *args, **kwargs):
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            raise ValueError("position='sinusoidal' needs the decoder to pass position_ids to its first block")
        pe = (sinusoidal_table(position_ids, hidden_states.shape[-1]) * self.hfpatch_pe_scale).to(hidden_states.dtype)
        return super().forward(hidden_states + pe.to(hidden_states.device), *args, **kwargs)
