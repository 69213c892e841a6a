"""Relative position encodings with learned parameters: T5's bucketed bias (position="t5") and Transformer-XL's
relative encoding (position="xl").

Both take the model's own position signal out first (RoPE becomes the identity, a learned table returns zeros:
patch.remove_positions), add their parameters, and switch the model to an attention function registered with
transformers' AttentionInterface (with its mask function in AttentionMaskInterface). Its path table (paths.py)
picks per call: for T5, compiled flex_attention with a score_mod reading the bias by distance (CUDA; the CPU for
bidirectional or softcapped inference), the piece path (split.near_far_bias: every distance from some D <=
max_distance on falls in the last bucket, so beyond D the bias is one constant per head and plain kernels do the
far keys; training too), else the written-out path (attention.biased_attention: a block of queries at a time, so
memory stays bounded). In causal training both flex and the pieces hold the bias constant and take the table's
gradient from the band of the D nearest keys (attention/distance_bias.py), not from an atomic add per score.
Transformer-XL's table (XL_PATHS) has, before the written-out path, one sdpa call on queries and keys widened by
the position term's sinusoid features (XLPositions.widened: exact by the addition formulas), on the CPU, gradients
included, and for training elsewhere the recomputed path (attention/recompute.py: the written-out scores computed
again in the backward pass instead of kept). The eager variants write all scores out at once and return the
weights.

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

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from ...adapters import Adapter
from ...edits import Edits
from ..attention import distance_bias, fa4, flex, paths, recompute, split
from ..attention.modules import attention_modules, use_attention
from ..attention.paths import AttentionPath
from ..attention.written import biased_attention, causal_of
from .absolute import sinusoidal_table
from .removal import remove_positions

if TYPE_CHECKING:
    from transformers import PreTrainedModel

T5_NAME, T5_EAGER = "hfpatch_t5", "hfpatch_t5_eager"
XL_NAME, XL_EAGER = "hfpatch_xl", "hfpatch_xl_eager"
T5_TABLE = "hfpatch_t5_bias"  # on the base model: nn.Embedding(num_buckets, heads)
T5_ATTR = "hfpatch_t5"  # on each attention module: a T5Bias pointing to that table
XL_ATTR = "hfpatch_xl"  # on each attention module: its XLPositions

# terms(query block [b, H, q, d], key [b, H, kv, d], q_pos [q], k_pos [kv]) -> (scaled logits, bias or None)
Terms = Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor | None]]
# an attention function as transformers calls it: (module, query, key, value, attention_mask, **options)
AttentionFunction = Callable[..., tuple[Tensor, Tensor | None]]


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

    def __init__(self, table: nn.Embedding, num_buckets: int, max_distance: int) -> None:
        self.table, self.num_buckets, self.max_distance = table, num_buckets, max_distance

    def __call__(self, q_pos: torch.Tensor, k_pos: torch.Tensor, bidirectional: bool) -> torch.Tensor:
        """[1, heads, q, k] bias."""
        buckets = t5_buckets(k_pos[None, :] - q_pos[:, None], bidirectional, self.num_buckets, self.max_distance)
        return self.table(buckets).permute(2, 0, 1)[None]


class XLPositions(nn.Module):
    """One layer's Transformer-XL position parameters: W_R (r_net), u and v."""

    def __init__(self, d_model: int, heads: int, head_dim: int, dtype: torch.dtype | None = None,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.d_model = d_model
        self.r_net = nn.Linear(d_model, heads * head_dim, bias=False, dtype=dtype, device=device)
        self.u = nn.Parameter(torch.zeros(heads, head_dim, dtype=dtype, device=device))
        self.v = nn.Parameter(torch.zeros(heads, head_dim, dtype=dtype, device=device))
        nn.init.zeros_(self.r_net.weight)

    def scores(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, scaling: float, causal: bool) -> Tensor:
        """[b, H, q, k] scores of a block of queries q [b, H, q, d] against keys k [b, H, k, d]."""
        heads, d = self.u.shape
        if q.shape[1] != heads or q.shape[-1] != d:
            raise ValueError(f"position='xl' was set up for {heads} heads of {d} channels, but the attention gets "
                             f"queries {tuple(q.shape)} [batch, heads, length, head_dim]")
        return xl_scores(q, k, q_pos, k_pos, scaling, causal, self.u, self.v, self.r_net.weight, self.d_model)

    def widened(self, query: Tensor, key: Tensor, value: Tensor, q_pos: Tensor,
                k_pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(q', k', v') whose plain dot products are the four terms: q'·k' = (q_i + u)·k_j + (q_i + v)·W_R R_{i-j}.
        R_{i-j} is sinusoidal: each frequency w contributes g_s·sin((i-j)w) + g_c·cos((i-j)w), with (g_s, g_c) the
        entries of g = W_Rᵀ(q_i + v) that meet sin and cos, and by the addition formulas that is
        (g_s sin iw + g_c cos iw)·cos jw + (g_c sin iw - g_s cos iw)·sin jw: a query side that depends on i and a
        key side that depends on j. So q' = [q + u, those two per frequency], k' = [k, cos jw, sin jw], and v' is v
        padded with zeros to the same width (the kernels want one width). Angles are computed in float64."""
        heads, d = self.u.shape
        D = self.d_model
        g = torch.einsum("bhqd,hdn->bhqn", query + self.v[:, None].to(query.dtype),
                         self.r_net.weight.view(heads, d, D).to(query.dtype))
        g_s, g_c = g[..., 0::2], g[..., 1::2]
        if g_c.shape[-1] < g_s.shape[-1]:  # odd d_model: the last frequency has a sine only
            g_c = torch.nn.functional.pad(g_c, (0, 1))
        w = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64, device=query.device) / D)
        qa, ka = q_pos.to(torch.float64)[:, None] * w, k_pos.to(torch.float64)[:, None] * w
        sin_i, cos_i = qa.sin().to(query.dtype), qa.cos().to(query.dtype)
        q_wide = torch.cat([query + self.u[:, None].to(query.dtype), g_s * sin_i + g_c * cos_i,
                            g_c * sin_i - g_s * cos_i], -1)
        j = torch.cat([ka.cos(), ka.sin()], -1).to(key.dtype)  # [kv, 2 * frequencies], the same for every head
        k_wide = torch.cat([key, j.expand(*key.shape[:2], *j.shape)], -1)
        v_wide = torch.nn.functional.pad(value, (0, q_wide.shape[-1] - value.shape[-1]))
        return q_wide, k_wide, v_wide


def xl_scores(q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, scaling: float, causal: bool, u: Tensor, v: Tensor,
              r_weight: Tensor, d_model: int) -> Tensor:
    """XLPositions.scores with the parameters given (u, v [H, d]; r_weight, W_R's weight [H * d, d_model]): the
    four terms, the position terms computed once per distance and gathered into [query, key]."""
    heads, d = u.shape
    content = torch.matmul(q + u[:, None].to(q.dtype), k.transpose(2, 3))  # (a) + (c)
    lo = int(q_pos[0]) - int(k_pos[-1])
    lo = max(lo, 0) if causal else lo  # keys after the query are masked: their distances are not needed
    hi = int(q_pos[-1]) - int(k_pos[0])
    distances = torch.arange(lo, hi + 1, device=q.device)
    r = torch.nn.functional.linear(sinusoidal_table(distances, d_model).to(r_weight.dtype), r_weight)
    r = r.view(-1, heads, d).transpose(0, 1)  # [H, distances, d]
    by_distance = torch.matmul(q + v[:, None].to(q.dtype), r.transpose(1, 2).to(q.dtype))  # (b) + (d)
    index = (q_pos[:, None] - k_pos[None, :] - lo).clamp(0, hi - lo)  # clamped entries are masked
    position = torch.gather(by_distance, -1, index.expand(*by_distance.shape[:2], *index.shape))
    return (content + position) * scaling


# ------------------------------------------------------------------------------------------ attention functions

def _attention(scheme: str) -> AttentionFunction:
    """The function for the sdpa name: the scheme's path table picks the path."""
    def forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                **kwargs: Any) -> tuple[Tensor, None]:
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        return paths.run(scheme, module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                         causal=causal_of(module, is_causal), kwargs=kwargs)
    return forward


def _eager(terms_of: Callable[[nn.Module, float, bool], Terms]) -> AttentionFunction:
    """The function for the eager name: all queries at once, returning the weights."""
    def forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        causal = causal_of(module, is_causal)
        paths.record(module, "eager")
        return biased_attention(module, query, key, value, attention_mask, terms_of(module, scaling, causal),
                                dropout, causal, False, kwargs.get("softcap"))
    return forward


def _written_out(terms_of: Callable[[nn.Module, float, bool], Terms]) -> paths.Runner:
    def run(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, *,
            scaling: float, dropout: float, causal: bool, softcap: float | None, kwargs: dict[str, Any]) -> Tensor:
        out, _ = biased_attention(module, query, key, value, attention_mask, terms_of(module, scaling, causal),
                                  dropout, causal, True, softcap)
        return out
    return run


def _t5_terms(module: nn.Module, scaling: float, causal: bool) -> Terms:
    bias = getattr(module, T5_ATTR)
    return lambda q, k, q_pos, k_pos: (torch.matmul(q, k.transpose(2, 3)) * scaling,
                                       bias(q_pos, k_pos, bidirectional=not causal))


def _xl_terms(module: nn.Module, scaling: float, causal: bool) -> Terms:
    xl = getattr(module, XL_ATTR)
    return lambda q, k, q_pos, k_pos: (xl.scores(q, k, q_pos, k_pos, scaling, causal), None)


# ------------------------------------------------------------------------------------------ T5's other kernels

def t5_band(bias: T5Bias, bidirectional: bool = False) -> int:
    """D: the distance from which every farther distance (in either direction when bidirectional) falls in the same
    bucket as D itself (D <= max_distance: T5 gives all distances past max_distance the last bucket)."""
    d = torch.arange(bias.max_distance + 1)
    D = 1
    for sign in (1, -1) if bidirectional else (1,):  # keys before the query, then after it
        buckets = t5_buckets(-sign * d, bidirectional, bias.num_buckets, bias.max_distance)
        changing = (buckets != buckets[-1]).nonzero()
        if len(changing):
            D = max(D, int(changing.max()) + 1)
    return D


def t5_near_far(bias: T5Bias, device: torch.device) -> tuple[Tensor, Tensor]:
    """Causal T5's bias by distance: (near [H, D], the bias of distances 0 .. D - 1; far [H], of every distance from
    D on), differentiable in the table."""
    distances = torch.arange(t5_band(bias), device=device)
    near = bias.table(t5_buckets(-distances, False, bias.num_buckets, bias.max_distance)).T  # [H, D]
    return near, bias.table.weight[bias.num_buckets - 1]


def _learns_t5(bias: T5Bias, causal: bool) -> bool:
    """Whether this call must pass a gradient to the T5 table through distance_bias (causal calls only: its
    band-and-rest form needs the keys after the query masked)."""
    return causal and torch.is_grad_enabled() and bias.table.weight.requires_grad


def _t5_pieces(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, *,
               scaling: float, dropout: float, causal: bool, softcap: float | None, kwargs: dict[str, Any]) -> Tensor:
    near, far = t5_near_far(getattr(module, T5_ATTR), query.device)
    out, lse = split.near_far_bias(query, key, value, attention_mask, scaling, near, far)
    out = distance_bias.with_gradient(out, lse, near, far, query, key, value, attention_mask, scaling)
    return out.transpose(1, 2).contiguous()


def t5_score_mod(bias: T5Bias, q_len: int, kv_len: int, bidirectional: bool, device: torch.device,
                 constant: bool = False) -> flex.ScoreMod:
    """T5's bias as a flex_attention score_mod: a lookup by distance d = query slot - key slot in the bias of the
    distances -D .. D ([heads, 2D + 1]; every farther distance shares the bucket of ±D). The table does not depend
    on the sequence length (a buffer sized by the length did not compile with dynamic shapes on the CPU). Gradients
    reach the T5 table through it, unless `constant` (the gradient then comes from distance_bias)."""
    D = t5_band(bias, bidirectional)
    dist = torch.arange(-D, D + 1, device=device)
    by_distance = bias.table(t5_buckets(-dist, bidirectional, bias.num_buckets, bias.max_distance)).T.contiguous()
    if constant:
        by_distance = by_distance.detach()
    shift = torch.tensor(kv_len - q_len, device=device)  # queries are the last q_len key slots
    # captured as tensors: with dynamic shapes a captured Python int becomes a symbol the CPU kernel cannot lower
    top, bottom = torch.tensor(D, device=device), torch.tensor(-D, device=device)

    def mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + by_distance[h, torch.minimum(torch.maximum(q_idx + shift - kv_idx, bottom), top) + top]
    return mod


def _t5_flex(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, *,
             scaling: float, dropout: float, causal: bool, softcap: float | None, kwargs: dict[str, Any]) -> Tensor:
    q_len, kv_len = query.shape[2], key.shape[2]
    bias = getattr(module, T5_ATTR)
    learns = _learns_t5(bias, causal)
    mods = flex.softcapped(t5_score_mod(bias, q_len, kv_len, not causal, query.device, constant=learns), softcap,
                           query.device)
    mask = flex.block_mask(flex.CAUSAL if causal else flex.EVERYTHING, q_len, kv_len, query.device, attention_mask)
    if not learns:
        return flex.attention(query, key, value, scaling, mods, mask).transpose(1, 2).contiguous()
    out, lse = flex.attention(query, key, value, scaling, mods, mask, lse=True)
    near, far = t5_near_far(bias, query.device)
    out = distance_bias.with_gradient(out, lse, near, far, query, key, value, attention_mask, scaling, softcap)
    return out.transpose(1, 2).contiguous()


def _t5_fa4(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, *,
            scaling: float, dropout: float, causal: bool, softcap: float | None, kwargs: dict[str, Any]) -> Tensor:
    """One FlashAttention-4 call whose score_mod reads the bias by distance (an aux tensor [H, D + 1], held
    constant); the table's gradient from distance_bias."""
    fa4.require_plain_causal(attention_mask, query.shape[2], key.shape[2])
    near, far = t5_near_far(getattr(module, T5_ATTR), query.device)
    table = torch.cat([near, far[:, None]], 1).detach().float().contiguous().view(-1)
    out, lse = fa4.attend(query, key, value, scaling, causal=True, score_mod=fa4.near_far_mod(near.shape[1]),
                          score_mod_bwd=fa4.additive_bwd(), aux=[table])
    out = distance_bias.with_gradient(out, lse, near, far, query, key, value, None, scaling)
    return out.transpose(1, 2).contiguous()


_T5_FLEX = AttentionPath("flex", _t5_flex, "compiled flex_attention with a score_mod reading the bias of each "
                         "distance, and a block mask", devices=frozenset({"cuda"}), softcap=True, bidirectional=True,
                         masks=frozenset({"none", "bool"}), worth=flex.worth_it)
T5_PATHS = (
    AttentionPath("fa4", _t5_fa4, "FlashAttention-4 with a score_mod reading the bias of each distance (Hopper, "
                  "Blackwell); the table's gradient from the band alone", devices=frozenset({"cuda"}), dtypes=paths.LOW,
                  masks=frozenset({"none", "bool"}), missing=fa4.missing),
    _T5_FLEX,
    AttentionPath("pieces", _t5_pieces, "kernel calls merged by log-sum-exp: the bias band (distances < D) as an "
                  "additive mask, the farther keys plain causal with T5's last-bucket bias; gradients by each call's "
                  "kernel backward, the table's from the band alone"),
    dataclasses.replace(_T5_FLEX, devices=frozenset({"cpu"}), grad_devices=frozenset()),  # after pieces on the CPU
    AttentionPath("written-out", _written_out(_t5_terms), "scores and bias written out, a block of queries at a time",
                  dropout=True, softcap=True, bidirectional=True),
)
XL_WIDE_MIN_SCORES = 3072 * 3072  # inference: below this the written-out path is faster (measured, see below)


def _xl_worth(call: paths.Call) -> str | None:
    """Training (with dropout: the recomputed path takes the rest) always takes the widened path (its memory is
    O(L), the written-out path's O(L²)); inference from XL_WIDE_MIN_SCORES query x key pairs up."""
    if call.grad or call.q_len * call.kv_len >= XL_WIDE_MIN_SCORES:
        return None
    return f"{call.q_len} x {call.kv_len} scores: below {XL_WIDE_MIN_SCORES:,} the written-out path is faster"


def _xl_widened(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, *,
                scaling: float, dropout: float, causal: bool, softcap: float | None,
                kwargs: dict[str, Any]) -> Tensor:
    kv_len, q_len, d = key.shape[2], query.shape[2], value.shape[-1]
    k_pos = torch.arange(kv_len, device=query.device)
    q, k, v = getattr(module, XL_ATTR).widened(query, key, value, k_pos[kv_len - q_len:], k_pos)
    out, _ = sdpa_attention_forward(module, q, k, v, attention_mask, dropout=dropout, scaling=scaling,
                                    is_causal=causal, **kwargs)
    return out[..., :d].contiguous()


def _xl_recomputed(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, *,
                   scaling: float, dropout: float, causal: bool, softcap: float | None,
                   kwargs: dict[str, Any]) -> Tensor:
    xl: XLPositions = getattr(module, XL_ATTR)
    heads, d = xl.u.shape
    if query.shape[1] != heads or query.shape[-1] != d:
        raise ValueError(f"position='xl' was set up for {heads} heads of {d} channels, but the attention gets "
                         f"queries {tuple(query.shape)} [batch, heads, length, head_dim]")
    groups = heads // key.shape[1]
    key, value = (t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in (key, value))
    kv_len, q_len = key.shape[2], query.shape[2]
    k_pos = torch.arange(kv_len, device=query.device)
    q_pos = k_pos[kv_len - q_len:]

    def scores(q: Tensor, s: int, e: int, hi: int, others: Sequence[Tensor]) -> Tensor:
        k, u, v, r_weight = others
        x = xl_scores(q, k[:, :, :hi], q_pos[s:e], k_pos[:hi], scaling, causal, u, v, r_weight, xl.d_model)
        return x if softcap is None else torch.tanh(x / softcap) * softcap

    out = recompute.attention(scores, query, (key, xl.u, xl.v, xl.r_net.weight), value, attention_mask, causal)
    return out.transpose(1, 2).contiguous()


def _grad_only(call: paths.Call) -> str | None:
    return None if call.grad else "inference: the written-out path computes the same without a backward to prepare"


# Transformer-XL's position term (q_i + v)·W_R R_{i-j} depends on the query vector and the distance together, so
# it is no score_mod of (head, i, j). By the sinusoids' addition formulas it is still one dot product, of queries
# and keys widened to head_dim + d_model channels (XLPositions.widened): one sdpa call, O(L) memory, gradients too,
# at the cost of the wider kernel (SmolLM2's shape: 64 -> 640 channels). Measured on the CPU (one thread, one
# layer, 9 heads): inference 0.93 vs 0.82 s written out at 2k, 2.9 vs 3.3 s at 4k, 14.4 vs 19 s at 8k; training at
# 4k 9 s and 1.25 GB vs 6.3 s and 2.05 GB, the written-out path keeping every block's weights for the backward pass
# ([L, L] per layer). So: inference from about 3k tokens. On CUDA the kernels' head-size limits (256 for flash) rule
# it out. Training takes the recomputed path first, everywhere: the written-out scores, a block of queries at a
# time, computed again in the backward pass instead of kept (recompute.py), O(block x L) memory. Measured on the CPU
# (eval/bench_training_paths.py: 2 layers, 4k tokens, one thread), a training step took 18.7 s and 1.26 GB peak
# against 19.8 s and 2.14 GB widened and 25.0 s and 3.51 GB written out; the widened path keeps training with
# attention dropout, which the recomputed one does not do.
XL_PATHS = (
    AttentionPath("recomputed", _xl_recomputed, "scores written out a block of queries at a time, and again in the "
                  "backward pass instead of kept", softcap=True, bidirectional=True, worth=_grad_only),
    AttentionPath("widened", _xl_widened, "one sdpa call on queries and keys widened by the position term's "
                  "sinusoid features", devices=frozenset({"cpu"}), dropout=True, bidirectional=True, worth=_xl_worth),
    AttentionPath("written-out", _written_out(_xl_terms), "content and position scores written out, a block of "
                  "queries at a time", dropout=True, softcap=True, bidirectional=True),
)
for _scheme, _name, _eager_name, _terms in (("t5", T5_NAME, T5_EAGER, _t5_terms), ("xl", XL_NAME, XL_EAGER, _xl_terms)):
    AttentionInterface.register(_name, _attention(_scheme))
    AttentionInterface.register(_eager_name, _eager(_terms))
    AttentionMaskInterface.register(_name, sdpa_mask)
    AttentionMaskInterface.register(_eager_name, eager_mask)


# ---------------------------------------------------------------------------------------------------- appliers

def apply_t5(model: PreTrainedModel, adapter: Adapter, req: dict, scheme: Any, edits: Edits) -> None:
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


def apply_xl(model: Any, adapter: Adapter, req: dict, scheme: Any, edits: Edits) -> None:
    remove_positions(model, adapter, req["scheme"], edits, reloadable=True)
    text = model.config.get_text_config()
    like = model.get_input_embeddings().weight
    for attn, heads in zip(attention_modules(model, adapter), adapter.heads):
        head_dim = getattr(attn, "head_dim", None) or getattr(text, "head_dim", None) or text.hidden_size // heads
        edits.set(attn, XL_ATTR, XLPositions(text.hidden_size, heads, head_dim, dtype=like.dtype, device=like.device))
    use_attention(model, XL_NAME, XL_EAGER, edits)
