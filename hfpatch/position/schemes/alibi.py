"""ALiBi (Press et al., 2022): no position embedding; each head adds −m_h·(i − j) to its attention scores
(−m_h·|i − j| in bidirectional encoders).

Two attention functions are registered with transformers (`AttentionInterface`), each with its mask function
(`AttentionMaskInterface`: without it transformers would hand the function no mask at all):

- "hfpatch_alibi" (models on sdpa or any other implementation): the path table `PATHS` (paths.py) picks, per call,
  the first of:
  - "fa4": one FlashAttention-4 call with ALiBi as its score_mod (CUDA, compute capability 9.x-11.x, the
    flash-attn-4 package; fp16/bf16, causal, no padding, no softcapping; gradients too);
  - "flash-attn": flash-attn 2's own ALiBi (`alibi_slopes`), for models loaded with
    attn_implementation="flash_attention_2" on CUDA, without a padding mask;
  - "factorised" (CPU, causal, no softcapping; gradients too): ONE ordinary sdpa call. −m(i − j) = m·j − m·i, and
    softmax ignores the per-row constant −m·i, so the bias is a dot product: two extra channels carry m/scale on
    the query side and the key's position on the key side (split as 256·hi + lo, so both are exact even in bf16).
    Key positions are centred on the queries (j − c), which keeps the added term small for the keys that matter;
  - "flex": compiled flex_attention with an ALiBi score_mod and a block mask (softcapping and bidirectional
    attention too; CUDA with gradients, the CPU for inference);
  - "written-out": the explicit path, one block of queries at a time, so at most [batch, heads, block, keys]
    scores exist at once (everything else: e.g. CPU training with softcapping).
- On the CPU the ALiBi paths run with denormal floats flushed to zero (`no_denormals`): ALiBi puts every head's
  keys at some distance 87-104 below the row's largest score, where exp() lands on denormals, which x86 CPUs compute
  10-100x slower (measured: the 2k forward 1.41x -> 1.13x the unpatched one). Those weights are < 1e-38 of the
  largest, so nothing that survives the softmax changes. The previous mode is restored after each call.
- "hfpatch_alibi_eager" (models loaded with attn_implementation="eager"): the explicit path on all queries at once,
  returning the attention weights like eager attention does.

Queries are taken to be the last q_len of the key slots (no cache, or a DynamicCache); the factorised path only
uses key positions, so it also holds for a StaticCache.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from ...adapters import Adapter
from ...edits import Edits
from ..attention import fa4, flex, kernels, paths
from ..attention.modules import attention_modules, use_attention
from ..attention.paths import AttentionPath
from ..attention.written import biased_attention, causal_of
from .removal import remove_positions

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SDPA_NAME = "hfpatch_alibi"
EAGER_NAME = "hfpatch_alibi_eager"
SLOPES_ATTR = "hfpatch_alibi_slopes"


def alibi_slopes(n_heads: int, max_bias: float = 8.0) -> list[float]:
    """The ALiBi paper's slopes: for n a power of two, m_h = 2^(−max_bias·h/n), h = 1..n; otherwise the slopes
    of the closest smaller power of two p, then every other slope of 2p for the remaining n − p heads."""
    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-max_bias * (h + 1) / n) for h in range(n)]

    p = 2 ** math.floor(math.log2(n_heads))
    if p == n_heads:
        return power_of_two(n_heads)
    return power_of_two(p) + power_of_two(2 * p)[0::2][: n_heads - p]


def alibi_bias(slopes: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, bidirectional: bool) -> torch.Tensor:
    """[H, q, k] additive bias: −m·(i − j), or −m·|i − j| when bidirectional. (Causal masking is separate.)"""
    dist = q_pos[:, None] - k_pos[None, :]
    dist = dist.abs() if bidirectional else dist
    return -slopes[:, None, None] * dist[None].to(slopes.dtype)


def _slopes(module: nn.Module, like: torch.Tensor) -> torch.Tensor:
    return getattr(module, SLOPES_ATTR).to(device=like.device, dtype=torch.float32)


# ------------------------------------------------------------------------------------------------- factorised path

def factorise(slopes: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
              centre: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query/key/value with the ALiBi channels appended: scaling·(q'·k') = scaling·q·k + m·(j − centre)."""
    b, h, q_len, _ = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    extra = 2  # padding to a multiple of 8 measured no faster once denormals are flushed
    j = torch.arange(kv_len, device=key.device, dtype=torch.float64) - centre
    hi = torch.floor(j / 256)
    lo = j - 256 * hi
    a = (slopes / scaling).to(query.dtype)  # one slope per query head
    q_cols = torch.zeros(b, h, q_len, extra, dtype=query.dtype, device=query.device)
    q_cols[..., 0] = (a * 256)[None, :, None]  # exact: a power-of-two multiple
    q_cols[..., 1] = a[None, :, None]
    k_cols = torch.zeros(b, kv_heads, kv_len, extra, dtype=key.dtype, device=key.device)
    k_cols[..., 0] = hi.to(key.dtype)
    k_cols[..., 1] = lo.to(key.dtype)
    v_cols = torch.zeros(b, kv_heads, kv_len, extra, dtype=value.dtype, device=value.device)
    return (torch.cat([query, q_cols], -1), torch.cat([key, k_cols], -1), torch.cat([value, v_cols], -1))


def alibi_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return paths.run("alibi", module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                     causal=causal_of(module, is_causal), kwargs=kwargs)


def _factorised(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, *, scaling: float, dropout: float, causal: bool,
                softcap: float | None, kwargs: dict[str, Any]) -> torch.Tensor:
    q_len, kv_len, d = query.shape[2], key.shape[2], query.shape[-1]
    q, k, v = factorise(_slopes(module, query), query, key, value, scaling, centre=kv_len - (q_len + 1) // 2)
    with no_denormals(query.device):
        out, _ = sdpa_attention_forward(module, q, k, v, attention_mask, dropout=dropout, scaling=scaling,
                                        is_causal=causal, **kwargs)
    return out[..., :d].contiguous()


def _flushing() -> bool:
    """Whether this thread flushes denormals (torch offers a setter only): a denormal times 2 reads as 0."""
    return (torch.tensor([1e-39]) * 2).item() == 0.0


@contextlib.contextmanager
def no_denormals(device: torch.device) -> Iterator[None]:
    if device.type != "cpu" or _flushing() or not torch.set_flush_denormal(True):
        yield
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


# --------------------------------------------------------------------------------------------------- explicit path

def explicit(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, causal: bool = True,
             block: bool = False, softcap: float | None = None,
             **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores with the bias written out, like eager attention; with `block`, a block of queries at a time."""
    slopes = _slopes(module, query)

    def terms(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor,
              k_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bias = alibi_bias(slopes, q_pos, k_pos, bidirectional=not causal)[None]
        return torch.matmul(q, k.transpose(2, 3)) * scaling, bias

    return biased_attention(module, query, key, value, attention_mask, terms, dropout, causal, block, softcap)


def alibi_eager(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    causal = getattr(module, "is_causal", True)
    paths.record(module, "eager")
    with no_denormals(query.device):
        return explicit(module, query, key, value, attention_mask, scaling, dropout, causal, block=False, **kwargs)


def _written_out(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, *, scaling: float, dropout: float, causal: bool,
                 softcap: float | None, kwargs: dict[str, Any]) -> torch.Tensor:
    with no_denormals(query.device):
        out, _ = explicit(module, query, key, value, attention_mask, scaling, dropout, causal, block=True,
                          softcap=softcap)
    return out


# ------------------------------------------------------------------------------------------------ other kernels

def score_mod(slopes: torch.Tensor, offset: torch.Tensor, bidirectional: bool) -> Callable[..., torch.Tensor]:
    """ALiBi as a flex_attention score_mod: −m_h·(i − j) (or −m_h·|i − j|), i = q_idx + offset the query's slot."""
    if bidirectional:
        return lambda score, b, h, q_idx, kv_idx: score - slopes[h] * (q_idx + offset - kv_idx).abs()
    return lambda score, b, h, q_idx, kv_idx: score - slopes[h] * (q_idx + offset - kv_idx)


def _flex(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          attention_mask: torch.Tensor | None, *, scaling: float, dropout: float, causal: bool, softcap: float | None,
          kwargs: dict[str, Any]) -> torch.Tensor:
    q_len, kv_len = query.shape[2], key.shape[2]
    offset = torch.tensor(kv_len - q_len, device=query.device)
    mods = flex.softcapped(score_mod(_slopes(module, query), offset, bidirectional=not causal), softcap, query.device)
    mask = flex.block_mask(flex.CAUSAL if causal else flex.EVERYTHING, q_len, kv_len, query.device, attention_mask)
    with no_denormals(query.device):
        out = flex.attention(query, key, value, scaling, mods, mask)
    return out.transpose(1, 2).contiguous()


def _fa4(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
         attention_mask: torch.Tensor | None, *, scaling: float, dropout: float, causal: bool, softcap: float | None,
         kwargs: dict[str, Any]) -> torch.Tensor:
    """One FlashAttention-4 call with ALiBi as its score_mod (the slopes an aux tensor)."""
    fa4.require_plain_causal(attention_mask, query.shape[2], key.shape[2])
    out, _ = fa4.attend(query, key, value, scaling, causal=True, score_mod=fa4.alibi_mod(),
                        score_mod_bwd=fa4.additive_bwd(), aux=[_slopes(module, query).contiguous()])
    return out.transpose(1, 2).contiguous()


def _flash(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           attention_mask: torch.Tensor | None, *, scaling: float, dropout: float, causal: bool, softcap: float | None,
           kwargs: dict[str, Any]) -> torch.Tensor:
    """flash-attn adds −m·|i + kv − q − j| to the scores: ALiBi with the queries as the last q keys."""
    return kernels.flash_attn(query, key, value, scaling, causal=causal, alibi_slopes=_slopes(module, query),
                              softcap=softcap or 0.0, dropout=dropout)


PATHS = (
    AttentionPath("fa4", _fa4, "FlashAttention-4 with an ALiBi score_mod (Hopper, Blackwell)",
                  devices=frozenset({"cuda"}), dtypes=paths.LOW, masks=frozenset({"none", "bool"}),
                  missing=fa4.missing),
    AttentionPath("flash-attn", _flash, "flash-attn 2 with its alibi_slopes (attn_implementation='flash_attention_2')",
                  devices=frozenset({"cuda"}), dtypes=paths.LOW, dropout=True, softcap=True, bidirectional=True,
                  masks=frozenset({"none"}), base=frozenset({"flash_attention_2"}), missing=kernels.flash_attn_missing),
    AttentionPath("factorised", _factorised, "one sdpa call, ALiBi carried by two extra query/key channels",
                  devices=frozenset({"cpu"}), dropout=True),
    AttentionPath("flex", _flex, "compiled flex_attention with an ALiBi score_mod and a block mask",
                  grad_devices=frozenset({"cuda"}), softcap=True, bidirectional=True,
                  masks=frozenset({"none", "bool"}), worth=flex.worth_it),
    AttentionPath("written-out", _written_out, "scores and bias written out, a block of queries at a time",
                  dropout=True, softcap=True, bidirectional=True),
)
AttentionInterface.register(SDPA_NAME, alibi_sdpa)
AttentionInterface.register(EAGER_NAME, alibi_eager)
AttentionMaskInterface.register(SDPA_NAME, sdpa_mask)
AttentionMaskInterface.register(EAGER_NAME, eager_mask)


def apply_alibi(model: PreTrainedModel, adapter: Adapter, req: dict, scheme: Any, edits: Edits) -> None:
    """The model's own position signal out; each attention module gets its heads' slopes and the attention functions
    above."""
    remove_positions(model, adapter, req["scheme"], edits)
    for attn, heads in zip(attention_modules(model, adapter), adapter.heads):
        slopes = torch.tensor(alibi_slopes(heads, req.get("alibi_max_bias", 8.0)))
        edits.set(attn, SLOPES_ATTR, slopes)
    use_attention(model, SDPA_NAME, EAGER_NAME, edits)
