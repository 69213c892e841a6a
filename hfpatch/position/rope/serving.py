"""What serving engines read of a RoPE scheme saved in transformers' own `rope_parameters`, as data the scheme records
carry (`serving=`, position/registry.py): for the rope_type the scheme saves as, the keys transformers reads, and
for each engine the keys it reads, how it computes the attention factor (the cos/sin magnitude of YaRN and
LongRoPE) and how it runs the scheme otherwise. interop/serving.py reads the records: the warnings of `hfpatch
describe` on a saved folder, the engine keys `hfpatch.save_pretrained` writes beside transformers' own, and the
table of docs/serving.md.

Read from the engines' source (vLLM 0.32: vllm/model_executor/layers/rotary_embedding/, get_rope and the YaRN,
LongRoPE and dynamic NTK classes; SGLang: python/sglang/srt/layers/rotary_embedding/, get_rope in factory.py,
yarn.py, rope_variant.py). Engines change: check the version you serve with.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

# The engines, and where each reads a checkpoint's RoPE
ENGINES = {"vLLM": "vllm/model_executor/layers/rotary_embedding/__init__.py (get_rope)",
           "SGLang": "python/sglang/srt/layers/rotary_embedding/factory.py (get_rope)"}


@dataclass(frozen=True)
class EngineReading:
    """How one engine reads a rope_type: the rope_parameters keys it reads; its attention factor ((rope_parameters,
    max_position_embeddings) -> the cos/sin magnitude it applies, and how, in words); how it runs the scheme
    differently beyond its keys; whether it serves it as transformers does only up to the trained window
    (`window_only`, its behaviour says why); whether the rope_parameters' factor multiplies
    max_position_embeddings in the longest sequence it serves (`window_factor`)."""

    reads: tuple[str, ...]
    attention: tuple[Callable[[dict, int], float], str] | None = None
    behaviour: str | None = None
    window_only: bool = False
    window_factor: bool = False


@dataclass(frozen=True)
class Serving:
    """What the engines read of a scheme saved as `rope_type`: the keys transformers reads for it (that the engines
    are checked against), each engine's reading, and the engine keys that carry the attention factor in place of
    transformers' attention_factor (written beside it on saving, with transformers' value)."""

    rope_type: str
    transformers: tuple[str, ...]
    engines: dict[str, EngineReading] = field(default_factory=dict)
    attention_keys: tuple[str, ...] = ()


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(s) + 1 (1 for s <= 1), as every engine writes it."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def longrope_attention(p: dict, max_positions: int) -> float:
    """Phi-3's LongRoPE magnitude from the served window: sqrt(1 + ln s / ln L), s = max_position_embeddings / L."""
    original = p["original_max_position_embeddings"]
    scale = max_positions / original
    return 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(original))


def vllm_yarn(p: dict, max_positions: int) -> float:
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    if p.get("mscale") and p.get("mscale_all_dim"):
        return yarn_mscale(p["factor"], p["mscale"]) / yarn_mscale(p["factor"], p["mscale_all_dim"])
    return yarn_mscale(p["factor"])


def mscale_longrope(p: dict, max_positions: int) -> float:
    """LongRoPE's magnitude in vLLM and SGLang: their own short_mscale / long_mscale keys, else the default."""
    return float(p.get("long_mscale") or longrope_attention(p, max_positions))


def sglang_yarn(p: dict, max_positions: int) -> float:
    m, m_all = p.get("mscale"), p.get("mscale_all_dim")
    base = yarn_mscale(p["factor"], m) / yarn_mscale(p["factor"], m_all) if m is not None and m_all is not None \
        else yarn_mscale(p["factor"])
    return base * p.get("attn_factor", 1.0)


LONGROPE_TEXT = ("sqrt(1 + ln s / ln L), s = max_position_embeddings / L, L = original_max_position_embeddings "
                 "(short_mscale / long_mscale, its own keys, replace it)")
_YARN_KEYS = ("rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate")
_LLAMA3_KEYS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_LONGROPE_KEYS = ("rope_theta", "short_factor", "long_factor", "original_max_position_embeddings", "short_mscale",
                  "long_mscale")
_DYNAMIC_KEYS = ("rope_theta", "factor", "alpha")

# ------------------------------------------------------------------------------------------- the records' forms

DEFAULT = Serving("default", (), {"vLLM": EngineReading(("rope_theta", "partial_rotary_factor")),
                                  "SGLang": EngineReading(("rope_theta",))})
LINEAR = Serving("linear", ("factor",), {"vLLM": EngineReading(("rope_theta", "factor"), window_factor=True),
                                         "SGLang": EngineReading(("rope_theta", "factor"))})
DYNAMIC = Serving("dynamic", ("factor",), {
    "vLLM": EngineReading(
        _DYNAMIC_KEYS, window_only=True, window_factor=True,
        behaviour="plain RoPE at every length: its base for max_position_embeddings x factor positions, "
                  "theta * (s - (s - 1))^(d/(d-2)), is theta itself; transformers grows the base with each "
                  "sequence's length past the trained window"),
    "SGLang": EngineReading(
        _DYNAMIC_KEYS,
        behaviour="one RoPE for every length, with the base transformers uses at a length of "
                  "max_position_embeddings x factor (plain RoPE when the factor is 1); transformers grows the "
                  "base with each sequence's length"),
})
YARN = Serving("yarn", ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                        "mscale", "mscale_all_dim", "truncate"), {
    "vLLM": EngineReading(
        (*_YARN_KEYS, "attention_factor", "mscale", "mscale_all_dim"),
        attention=(vllm_yarn, "attention_factor; else (0.1 mscale ln factor + 1) / (0.1 mscale_all_dim ln factor + "
                              "1) when both are given; else 0.1 ln factor + 1 (as transformers)")),
    "SGLang": EngineReading(
        (*_YARN_KEYS, "attn_factor", "extrapolation_factor", "mscale", "mscale_all_dim"),
        attention=(sglang_yarn, "(0.1 mscale ln factor + 1) / (0.1 mscale_all_dim ln factor + 1) when both are "
                                "given, else 0.1 ln factor + 1; times attn_factor (its own key, default 1)")),
})
LLAMA3 = Serving("llama3", ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
                 {"vLLM": EngineReading(_LLAMA3_KEYS), "SGLang": EngineReading(_LLAMA3_KEYS)})
LONGROPE = Serving("longrope", ("factor", "original_max_position_embeddings", "attention_factor", "short_factor",
                                "long_factor"), {
    "vLLM": EngineReading(
        _LONGROPE_KEYS, attention=(mscale_longrope, LONGROPE_TEXT),
        behaviour="the long factors for every sequence once the served length (max_model_len) exceeds "
                  "original_max_position_embeddings; transformers switches per sequence"),
    "SGLang": EngineReading(_LONGROPE_KEYS, attention=(mscale_longrope, LONGROPE_TEXT)),
}, attention_keys=("short_mscale", "long_mscale"))
