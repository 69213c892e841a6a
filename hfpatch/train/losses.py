"""Causal-LM losses scored chunk by chunk: full-vocabulary logits exist for `chunk` positions at a time, and each
chunk is recomputed in the backward pass (activation checkpointing), so long sequences and big vocabularies fit.
Recomputing costs one more pass through the LM head, so it is only done when the logits would be big (`auto_chunk`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_loss(h, labels, head, h_teacher, head_teacher, temperature, alpha):
    logits = head(h).float()
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    if h_teacher is None:
        return ce, torch.zeros((), device=h.device)
    with torch.no_grad():
        t = F.log_softmax(head_teacher(h_teacher).float() / temperature, dim=-1)
    s = F.log_softmax(logits / temperature, dim=-1)
    mask = (labels != -100).unsqueeze(-1)
    kl = (t.exp() * (t - s) * mask).sum() * temperature**2
    return ce, kl


LOGITS_BUDGET = 1 << 30  # bytes of fp32 logits above which the loss is chunked


def auto_chunk(batch: int, seq_len: int, vocab: int, chunk: int | None) -> int | None:
    """The chunk to use: the configured one, else None (one piece) while [batch, seq_len, vocab] fp32 logits
    fit in LOGITS_BUDGET, else 512 positions."""
    if chunk:
        return chunk
    return None if batch * seq_len * vocab * 4 <= LOGITS_BUDGET else 512


def chunked_lm_loss(hidden, labels, head, chunk=None, hidden_teacher=None, head_teacher=None, temperature=1.0,
                    alpha=0.0):
    """hidden [B, L, d] (already aligned: position t predicts labels[:, t]), labels [B, L] (-100 = ignore).
    Returns (loss, ce, kl): ce and kl are means per scored token; loss = (1 - alpha) ce + alpha kl."""
    count = (labels != -100).sum().clamp(min=1)
    if not chunk or chunk >= hidden.shape[1]:  # one piece, no recomputation
        ce, kl = _chunk_loss(hidden, labels, head, hidden_teacher, head_teacher, temperature, alpha)
        ce, kl = ce / count, kl / count
        return (1 - alpha) * ce + alpha * kl, ce, kl
    ce_sum = hidden.new_zeros((), dtype=torch.float32)
    kl_sum = hidden.new_zeros((), dtype=torch.float32)
    for s in range(0, hidden.shape[1], chunk):
        e = s + chunk
        ht = None if hidden_teacher is None else hidden_teacher[:, s:e]
        ce, kl = checkpoint(_chunk_loss, hidden[:, s:e], labels[:, s:e], head, ht, head_teacher, temperature, alpha,
                            use_reentrant=False)
        ce_sum, kl_sum = ce_sum + ce, kl_sum + kl
    ce, kl = ce_sum / count, kl_sum / count
    return (1 - alpha) * ce + alpha * kl, ce, kl


def shift(ids: torch.Tensor) -> torch.Tensor:
    """Labels for next-token prediction aligned with the positions: labels[:, t] = ids[:, t + 1]; last = ignore."""
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    return labels
