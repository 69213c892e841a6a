"""The positions of one attention call's queries and key slots, for the attention functions that compute with
positions themselves (Self-Extend, Dual Chunk Attention, the attention temperature)."""

from __future__ import annotations

import torch


def positions(position_ids: torch.Tensor | None, batch: int, q_len: int, kv_len: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(query positions [b, q], key positions [b, kv]). Without a cache the keys are the queries; with one, the
    cached keys continue the queries' positions backwards, one per slot."""
    if position_ids is None:
        q = torch.arange(kv_len - q_len, kv_len, device=device)[None]
    else:
        q = position_ids.to(device)
    q = q.expand(batch, q_len)
    if q_len == kv_len:
        return q, q
    return q, torch.arange(kv_len, device=device)[None] + (q[:, -1:] - (kv_len - 1))
