"""Two position schemes as a user outside hfpatch writes them: each is its code and ONE `register(...)` call that
carries everything hfpatch reads of it. tests/test_scheme_records.py imports this file in a fresh process only
(importing it registers the schemes for the rest of the process).

- `geometric`, a RoPE scaling: every rotary pair i of n stretched by λ_i = factor^(i / (n - 1)) (the highest
  frequency kept, the lowest divided by the factor), with its GGUF forms both ways (a rope_freqs tensor of the λ_i),
  its saved form for the serving engines (transformers' longrope with short = long factors and an attention factor
  of 1), its search space (the factor), and its per-pair factors among the seeds of the LongRoPE search;
- `decay`, a scheme with an attention function of its own: the model's position signal taken out, every score
  lowered by slope x (query position - key position), computed by one of two attention paths (one sdpa call with
  the bias in its mask, or the scores written out).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hfpatch.position.attention import paths
from hfpatch.position.attention.modules import attention_modules, use_attention
from hfpatch.position.attention.paths import AttentionPath
from hfpatch.position.attention.written import biased_attention, causal_of
from hfpatch.position.registry import Option, Scheme, positive, register, rope_scaling
from hfpatch.position.rope import builders, serving
from hfpatch.position.rope.llamacpp import ROPE_FREQS_ARCHS, TENSORS, Gguf, carries_rope_freqs, plain_keys
from hfpatch.position.schemes.removal import remove_positions
from hfpatch.position.search_space import Param, Space

# ------------------------------------------------------------------------------------------------- geometric


# --8<-- [start:geometric]
def geometric_factors(factor: float, pairs: int) -> list[float]:
    """λ_i = factor^(i / (pairs - 1)), highest frequency first."""
    return [factor ** (i / (pairs - 1)) for i in range(pairs)]


def geometric(base: dict, window: int, opts: dict, dim: int) -> dict:
    """In transformers' vocabulary: LongRoPE with the same factors within and past the window, and no attention
    scaling."""
    factors = geometric_factors(opts["factor"], dim // 2)
    return {**builders.plain(base, window, opts, dim), "rope_type": "longrope", "factor": opts["factor"],
            "original_max_position_embeddings": window, "short_factor": factors, "long_factor": factors,
            "attention_factor": 1.0}


def write_geometric(info: Any, params: dict, opts: dict, n_positions: int) -> tuple[dict, dict]:
    """llama.cpp divides each pair's angle by its rope_freqs entry: the λ_i themselves."""
    if info.arch not in ROPE_FREQS_ARCHS:
        raise ValueError(f"geometric lives in a rope_freqs tensor, which llama.cpp's {info.arch} loader does not read")
    return plain_keys("none"), {TENSORS["freqs"]: np.asarray(params["long_factor"], dtype=np.float32)}


def read_geometric(info: Any) -> dict | None:
    """A rope_freqs tensor whose entries grow geometrically from 1 is this scheme at its last entry."""
    if not carries_rope_freqs(info):
        return None
    freqs = info.tensors[TENSORS["freqs"]]
    factor = float(freqs[-1])
    if factor <= 1 or not np.allclose(freqs, geometric_factors(factor, len(freqs)), rtol=1e-5, atol=0):
        return None
    return {"factor": factor, "original_max_position_embeddings": info.window}


register("geometric", rope_scaling(
    geometric, "every rotary pair i of n stretched by factor^(i / (n - 1))",
    gguf=Gguf(write_geometric, read_geometric, scaling_type="none"),
    serving=serving.LONGROPE,
    search=Space({"factor": Param(lambda s, p: max(1.01, s.ratio / 2), lambda s, p: 2 * s.ratio, sigma=0.2)},
                 start=lambda s: {"factor": s.ratio}, short=("factor",),
                 fixed=lambda s: {"original_max_position_embeddings": s.window}),
    per_pair_seed=True))
# --8<-- [end:geometric]


# ----------------------------------------------------------------------------------------------------- decay

# --8<-- [start:decay]
SLOPE = "decay_slope"  # each attention module's slope
ATTENTION = "decay_test"  # the attention function registered with transformers


def decay_bias(module: torch.nn.Module, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """[q, kv]: -slope x (i - j)."""
    return -getattr(module, SLOPE) * (q_pos[:, None] - k_pos[None, :]).to(torch.float32)


def one_sdpa(module, query, key, value, attention_mask, *, scaling, dropout, causal, softcap, kwargs):
    q_len, kv_len = query.shape[2], key.shape[2]
    q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)
    k_pos = torch.arange(kv_len, device=query.device)
    bias = decay_bias(module, q_pos, k_pos).masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    out, _ = sdpa_attention_forward(module, query, key, value, bias[None, None].to(query.dtype), dropout=dropout,
                                    scaling=scaling, is_causal=False)
    return out


def written_out(module, query, key, value, attention_mask, *, scaling, dropout, causal, softcap, kwargs):
    def terms(q, k, q_pos, k_pos):
        return torch.matmul(q, k.transpose(2, 3)) * scaling, decay_bias(module, q_pos, k_pos)[None, None]

    out, _ = biased_attention(module, query, key, value, attention_mask, terms, dropout, causal, block=True,
                              softcap=softcap)
    return out


DECAY_PATHS = (
    AttentionPath("one-sdpa", one_sdpa, "one sdpa call, the bias in its mask", masks=frozenset({"none"})),
    AttentionPath("written-out", written_out, "scores and bias written out", dropout=True, softcap=True,
                  bidirectional=True),
)


def attend(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return paths.run("decay", module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                     causal=causal_of(module, is_causal), kwargs=kwargs)


AttentionInterface.register(ATTENTION, attend)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def apply_decay(model, adapter, req, scheme, edits) -> None:
    remove_positions(model, adapter, req["scheme"], edits)
    for attn in attention_modules(model, adapter):
        edits.set(attn, SLOPE, float(req.get("slope", 0.1)))
    use_attention(model, ATTENTION, ATTENTION, edits)


register("decay", Scheme(
    apply_decay, ("known_positions", "attention_interface"), "every score lowered by slope x the distance",
    options={"slope": Option(positive, "the penalty per token of distance (default 0.1)")},
    limit=None, native=False, paths=DECAY_PATHS, gguf_refusal="decay is a test scheme"))
# --8<-- [end:decay]
