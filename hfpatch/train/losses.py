"""Causal-LM losses scored chunk by chunk: full-vocabulary logits exist for `chunk` positions at a time, and each
chunk is recomputed in the backward pass (activation checkpointing), so long sequences and big vocabularies fit.
Recomputing costs one more pass through the LM head, so it is only done when the logits would be big (`auto_chunk`).

`fused_lm_loss` (config `fused_loss`) goes further for the plain cross-entropy: each chunk's gradient is computed in
the forward pass, straight from its logits (softmax - one-hot), so one [chunk, vocab] buffer exists at a time
instead of the four a recomputed chunk makes (logits, log-softmax, and their gradients), and the LM head is not run a
second time (Liger's fused linear cross-entropy, ALST's tiled logits loss).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_loss(h: torch.Tensor, labels: torch.Tensor, head: Callable, h_teacher: torch.Tensor | None,
                head_teacher: Callable | None, temperature: float, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(h).float()
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    if h_teacher is None:
        return ce, torch.zeros((), device=h.device)
    assert head_teacher is not None  # a teacher's hidden states always come with its head
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


def chunked_lm_loss(hidden: torch.Tensor, labels: torch.Tensor, head: Callable, chunk: int | None = None,
                    hidden_teacher: torch.Tensor | None = None, head_teacher: Callable | None = None,
                    temperature: float = 1.0, alpha: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """sum of CE(softcap(hidden @ weight.T + bias), labels) over the scored rows, / count. The gradients are made in
    the forward pass, chunk by chunk, and only scaled by the incoming gradient in the backward pass."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk, count, softcap) -> torch.Tensor:
        grad_h = torch.empty_like(hidden)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_b = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            h, y = hidden[s:s + chunk], labels[s:s + chunk]
            z = F.linear(h, weight, bias).float()  # the one [chunk, vocab] buffer, reused in place below
            slope = None
            if softcap:
                z.div_(softcap).tanh_()
                slope = 1 - z * z  # d softcap(x) / dx at x, from tanh(x / cap)
                z.mul_(softcap)
            scored = y != -100
            target = y.clamp(min=0)[:, None]
            picked = z.gather(1, target)[:, 0]
            top = z.amax(dim=-1, keepdim=True)
            g = z.sub_(top).exp_()
            norm = g.sum(dim=-1, keepdim=True)
            total += ((top[:, 0] + norm[:, 0].log() - picked) * scored).sum()  # logsumexp - target logit
            g.div_(norm)  # softmax
            g.scatter_add_(1, target, -scored[:, None].to(g.dtype))  # - one-hot on the scored rows
            g.mul_(scored[:, None])  # rows not scored contribute nothing
            if slope is not None:
                g.mul_(slope)
                del slope
            grad_h[s:s + chunk] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            grad_w.addmm_(g.t(), h.float())
            if grad_b is not None:
                grad_b += g.sum(0)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.count, ctx.dtypes = count, (weight.dtype, None if bias is None else bias.dtype)
        return total / count

    @staticmethod
    def backward(ctx, grad_out) -> tuple[torch.Tensor | None, ...]:
        # scaled in place: the saved gradients are used once (a second backward through this graph is an error)
        grad_h, grad_w, grad_b = ctx.saved_tensors
        scale = grad_out / ctx.count
        gb = None if grad_b is None else grad_b.mul_(scale).to(ctx.dtypes[1])
        return grad_h.mul_(scale.to(grad_h.dtype)), grad_w.mul_(scale).to(ctx.dtypes[0]), gb, None, None, None, None


def fused_lm_loss(hidden: torch.Tensor, labels: torch.Tensor, head: torch.nn.Linear, chunk: int,
                  softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, ce, kl=0) like chunked_lm_loss without a teacher, for a linear LM head (optionally soft-capped)."""
    count = (labels != -100).sum().clamp(min=1)
    ce = _FusedLinearCrossEntropy.apply(hidden.flatten(0, 1), head.weight, head.bias, labels.flatten(), chunk, count,
                                        softcap)
    return ce, ce, torch.zeros((), device=hidden.device)

