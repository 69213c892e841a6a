"""Relative position encodings with learned parameters: T5's bucketed bias (position="t5") and Transformer-XL's
relative encoding (position="xl").

Both take the model's own position signal out first (RoPE becomes the identity, a learned table returns zeros:
patch.remove_positions), add their parameters, and switch the model to an attention function registered with
transformers' AttentionInterface (with its mask function in AttentionMaskInterface) that writes the scores out
(attention.biased_attention: a block of queries at a time, so memory stays bounded; the eager variant returns the
weights).

T5 (Raffel et al. 2020, §2.1): each head adds a learned scalar to score(i, j), looked up by a bucket of the relative
position j − i. Half of the buckets hold the exact distances 0 .. n/2 − 1, the other half logarithmically wider
ranges up to `max_distance`, beyond which all distances share the last bucket. Causal models bucket the distance
i − j ≥ 0 (T5's decoder); bidirectional models (bert) give the keys after the query their own half of the buckets
(T5's encoder). As in T5, one table of [num_buckets, heads] serves every layer (it sits on the base model; each
attention module points to it); it starts at zero, so a freshly patched model attends as without positions.

Transformer-XL (Dai et al. 2019, §3.3): score(i, j) = q_i·k_j + q_i·W_R R_{i−j} + u·k_j + v·W_R R_{i−j}, times the
model's attention scaling: content, content-dependent position, global content bias and global position bias. R is
the sinusoidal table of the distance i − j in the model's width, W_R a projection to the heads, u and v one vector
per head; every layer has its own W_R, u, v (XL's untied form), all zero at start. The position terms are computed
once per distance, [heads, distances], and gathered into [query, key] (a gather instead of XL's pad-and-reshape
shift, same result).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from ..adapters import Adapter
from ..edits import Edits
from .absolute import sinusoidal_table
from .attention import biased_attention, causal_of
from .patch import attention_modules, remove_positions, use_attention

T5_NAME, T5_EAGER = "hfpatch_t5", "hfpatch_t5_eager"
XL_NAME, XL_EAGER = "hfpatch_xl", "hfpatch_xl_eager"
T5_TABLE = "hfpatch_t5_bias"  # on the base model: nn.Embedding(num_buckets, heads)
T5_ATTR = "hfpatch_t5"  # on each attention module: a T5Bias pointing to that table
XL_ATTR = "hfpatch_xl"  # on each attention module: its XLPositions


def t5_buckets(relative_position: torch.Tensor, bidirectional: bool, num_buckets: int = 32,
               max_distance: int = 128) -> torch.Tensor:
    """The bucket of each relative position (key position − query position), as T5 defines it."""
    n = num_buckets
    offset: torch.Tensor | int = 0
    if bidirectional:
        n //= 2
        offset = (relative_position > 0).long() * n  # keys after the query: the upper half of the buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)  # keys after the query are masked anyway
    exact = n // 2
    # distances from `exact` to `max_distance` spread over the other n - exact buckets on a log scale
    far = exact + (torch.log(distance.clamp(min=exact).float() / exact) / math.log(max_distance / exact)
                   * (n - exact)).long()
    return offset + torch.where(distance < exact, distance, far.clamp(max=n - 1))


class T5Bias:
    """What an attention module reads: the shared table and the bucketing options. A plain object, so the table
    stays one parameter of the base model, not a submodule of every attention module."""

    def __init__(self, table: nn.Embedding, num_buckets: int, max_distance: int):
        self.table, self.num_buckets, self.max_distance = table, num_buckets, max_distance

    def __call__(self, q_pos: torch.Tensor, k_pos: torch.Tensor, bidirectional: bool) -> torch.Tensor:
        """[1, heads, q, k] bias."""
        buckets = t5_buckets(k_pos[None, :] - q_pos[:, None], bidirectional, self.num_buckets, self.max_distance)
        return self.table(buckets).permute(2, 0, 1)[None]


class XLPositions(nn.Module):
    """One layer's Transformer-XL position parameters: W_R (r_net), u and v."""

    def __init__(self, d_model: int, heads: int, head_dim: int, dtype=None, device=None):
        super().__init__()
        self.d_model = d_model
        self.r_net = nn.Linear(d_model, heads * head_dim, bias=False, dtype=dtype, device=device)
        self.u = nn.Parameter(torch.zeros(heads, head_dim, dtype=dtype, device=device))
        self.v = nn.Parameter(torch.zeros(heads, head_dim, dtype=dtype, device=device))
        nn.init.zeros_(self.r_net.weight)

    def scores(self, q, k, q_pos, k_pos, scaling: float, causal: bool) -> torch.Tensor:
        """[b, H, q, k] scores of a block of queries q [b, H, q, d] against keys k [b, H, k, d]."""
        heads, d = self.u.shape
        if q.shape[1] != heads or q.shape[-1] != d:
            raise ValueError(f"position='xl' was set up for {heads} heads of {d} channels, but the attention gets "
                             f"queries {tuple(q.shape)} [batch, heads, length, head_dim]")
        content = torch.matmul(q + self.u[:, None].to(q.dtype), k.transpose(2, 3))  # (a) + (c)
        lo = int(q_pos[0]) - int(k_pos[-1])
        lo = max(lo, 0) if causal else lo  # keys after the query are masked: their distances are not needed
        hi = int(q_pos[-1]) - int(k_pos[0])
        distances = torch.arange(lo, hi + 1, device=q.device)
        r = self.r_net(sinusoidal_table(distances, self.d_model).to(self.r_net.weight.dtype))
        r = r.view(-1, heads, d).transpose(0, 1)  # [H, distances, d]
        by_distance = torch.matmul(q + self.v[:, None].to(q.dtype), r.transpose(1, 2).to(q.dtype))  # (b) + (d)
        index = (q_pos[:, None] - k_pos[None, :] - lo).clamp(0, hi - lo)  # clamped entries are masked
        position = torch.gather(by_distance, -1, index.expand(*by_distance.shape[:2], *index.shape))
        return (content + position) * scaling


# ------------------------------------------------------------------------------------------ attention functions

def _attention(terms_of, block: bool):
    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        causal = causal_of(module, is_causal)
        return biased_attention(module, query, key, value, attention_mask, terms_of(module, scaling, causal),
                                dropout, causal, block, kwargs.get("softcap"))
    return forward


def _t5_terms(module, scaling, causal):
    bias = getattr(module, T5_ATTR)
    return lambda q, k, q_pos, k_pos: (torch.matmul(q, k.transpose(2, 3)) * scaling,
                                       bias(q_pos, k_pos, bidirectional=not causal))


def _xl_terms(module, scaling, causal):
    xl = getattr(module, XL_ATTR)
    return lambda q, k, q_pos, k_pos: (xl.scores(q, k, q_pos, k_pos, scaling, causal), None)


for _name, _eager, _terms in ((T5_NAME, T5_EAGER, _t5_terms), (XL_NAME, XL_EAGER, _xl_terms)):
    AttentionInterface.register(_name, _attention(_terms, block=True))
    AttentionInterface.register(_eager, _attention(_terms, block=False))
    AttentionMaskInterface.register(_name, sdpa_mask)
    AttentionMaskInterface.register(_eager, eager_mask)


# ---------------------------------------------------------------------------------------------------- appliers

def apply_t5(model, adapter: Adapter, req: dict, scheme, edits: Edits) -> None:
    if len(set(adapter.heads)) != 1:
        raise ValueError("position='t5' shares one bias table across the layers (as T5 does), "
                         f"but {adapter.model_type}'s attention layers have different head counts "
                         f"({sorted(set(adapter.heads))})")
    remove_positions(model, adapter, req["scheme"], edits, reloadable=True)
    like = model.get_input_embeddings().weight
    n = req.get("num_buckets", 32)
    table = nn.Embedding(n, adapter.heads[0], dtype=like.dtype, device=like.device)
    nn.init.zeros_(table.weight)
    edits.set(model.base_model, T5_TABLE, table)
    bias = T5Bias(table, n, req.get("max_distance", 128))
    for attn in attention_modules(model, adapter):
        edits.set(attn, T5_ATTR, bias)
    use_attention(model, T5_NAME, T5_EAGER, edits)


def check_t5(req: dict) -> None:
    n, far = req.get("num_buckets", 32), req.get("max_distance", 128)
    if n < 4:
        raise ValueError(f"num_buckets must be at least 4 (half exact distances, half log-spaced, per direction), "
                         f"got {n}")
    if far <= n // 2:
        raise ValueError(f"max_distance must be greater than num_buckets / 2 (the distances with a bucket of their "
                         f"own), got max_distance={far} with num_buckets={n}")


def apply_xl(model, adapter: Adapter, req: dict, scheme, edits: Edits) -> None:
    remove_positions(model, adapter, req["scheme"], edits, reloadable=True)
    text = model.config.get_text_config()
    like = model.get_input_embeddings().weight
    for attn, heads in zip(attention_modules(model, adapter), adapter.heads):
        head_dim = getattr(attn, "head_dim", None) or getattr(text, "head_dim", None) or text.hidden_size // heads
        edits.set(attn, XL_ATTR, XLPositions(text.hidden_size, heads, head_dim, dtype=like.dtype, device=like.device))
    use_attention(model, XL_NAME, XL_EAGER, edits)
