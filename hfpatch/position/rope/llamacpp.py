"""llama.cpp's RoPE metadata for each RoPE scheme hfpatch has: which keys and tensors carry it, computed from the same
rope_parameters `hfpatch.patch` builds (position/rope/builders.py) and transformers' RoPE functions. Pure functions
of numbers (no GGUF file is read or written here): the scheme records (position/registry.py) name their form, and
interop/gguf.py writes it.

A form takes (info: what the GGUF says of its RoPE — arch, n_rot —, the scheme's rope_parameters, the options, the
extended window) and returns (metadata keys without the "{arch}." prefix: {key: (value, type)}, {tensor: float32
array}), or raises ValueError saying why this architecture's llama.cpp loader cannot carry it.

Read off llama.cpp's source (src/llama-model.cpp, src/llama-context.cpp, src/models/*.cpp) as vendored by
llama-cpp-python 0.3.36.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from . import builders

# Architectures whose loader creates a `rope_freqs` tensor (per-frequency divisors of the angle): the only way a GGUF
# carries Llama 3.1's frequency-dependent scaling.
ROPE_FREQS_ARCHS = frozenset({"llama", "llama4", "deci", "refact", "nanbeige", "llada", "gemma4", "exaone", "exaone4",
                              "exaone-moe", "granite", "granitemoe", "granitehybrid", "granite_swa", "minicpm",
                              "arcee", "falcon-h1", "apertus", "cogvlm", "pangu-embedded", "mistral3", "step35"})

# Architectures whose loader creates `rope_factors_long` / `rope_factors_short` (LongRoPE); most of them only when
# the scaling type is "longrope".
LONGROPE_ARCHS = frozenset({"llama", "deci", "refact", "granite", "granitemoe", "granite_swa", "minicpm", "minicpm3",
                            "mistral3", "phi3", "phimoe", "apertus", "pangu-embedded", "step35"})

# Architectures whose loader reads yarn_beta_fast / yarn_beta_slow from metadata; the others always use 32 and 1.
YARN_BETA_ARCHS = frozenset({"grok", "mistral3"})

YARN_BETA_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0}

TENSORS = {"freqs": "rope_freqs.weight", "long": "rope_factors_long.weight", "short": "rope_factors_short.weight"}

def rope_numbers(params: dict, n_rot: int, n_positions: int):
    """(inverse frequencies as float64, attention factor) of transformers' RoPE function for `params`."""
    config = LlamaConfig(hidden_size=n_rot, num_attention_heads=1, head_dim=n_rot, num_hidden_layers=1,
                         vocab_size=2, intermediate_size=2, max_position_embeddings=n_positions,
                         rope_parameters=dict(params), bos_token_id=None, eos_token_id=None, pad_token_id=None)
    rope_type = params["rope_type"]
    default = LlamaRotaryEmbedding.compute_default_rope_parameters
    fn = default if rope_type == "default" else ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, attention_factor = fn(config)
    return inv_freq.double().numpy(), float(attention_factor)

def yarn_attn_factor(attention_factor: float, factor: float) -> float:
    """llama.cpp multiplies YaRN's angles by attn_factor * (1 + 0.1 ln s) (it applies the paper's default itself,
    llama-context.cpp), so the metadata holds the attention factor divided by that default."""
    return attention_factor / (1.0 + 0.1 * math.log(factor))

def plain_keys(kind: str, **extra: Any) -> dict:
    return {"rope.scaling.type": (kind, "str"), **extra}

def rope_form(info: Any, params: dict, opts: dict, n_positions: int):
    return plain_keys("none"), {}

def linear_form(info: Any, params: dict, opts: dict, n_positions: int):
    return plain_keys("linear", **{"rope.scaling.factor": (params["factor"], "f32")}), {}

def ntk_form(info: Any, params: dict, opts: dict, n_positions: int):
    return plain_keys("none"), {}  # the raised base is the plan's rope.freq_base

def yarn_form(info: Any, params: dict, opts: dict, n_positions: int):
    if opts.get("truncate") is False:
        raise ValueError("yarn with truncate=False: llama.cpp always rounds YaRN's correction range to whole "
                         "channels (truncate=True)")
    betas = {k: float(params.get(k, v)) for k, v in YARN_BETA_DEFAULTS.items()}
    if betas != YARN_BETA_DEFAULTS and info.arch not in YARN_BETA_ARCHS:
        raise ValueError(f"yarn with beta_fast={betas['beta_fast']:g}, beta_slow={betas['beta_slow']:g}: llama.cpp's "
                         f"{info.arch} loader does not read YaRN's betas from metadata (only "
                         f"{', '.join(sorted(YARN_BETA_ARCHS))} do) and uses 32 and 1; serve those, or run llama.cpp "
                         f"with --yarn-beta-fast {betas['beta_fast']:g} --yarn-beta-slow {betas['beta_slow']:g}")
    _, attention = rope_numbers(params, info.n_rot, n_positions)
    return plain_keys("yarn", **{
        "rope.scaling.factor": (params["factor"], "f32"),
        "rope.scaling.attn_factor": (yarn_attn_factor(attention, params["factor"]), "f32"),
        "rope.scaling.yarn_ext_factor": (1.0, "f32"),
        "rope.scaling.yarn_beta_fast": (betas["beta_fast"], "f32"),
        "rope.scaling.yarn_beta_slow": (betas["beta_slow"], "f32"),
    }), {}

def llama3_form(info: Any, params: dict, opts: dict, n_positions: int):
    if info.arch not in ROPE_FREQS_ARCHS:
        raise ValueError(f"llama3 scaling lives in a rope_freqs tensor, which llama.cpp's {info.arch} loader does not "
                         f"read (architectures that do: {', '.join(sorted(ROPE_FREQS_ARCHS))})")
    scaled, _ = rope_numbers(params, info.n_rot, n_positions)
    plain, _ = rope_numbers(builders.plain(params, 0, {}, 0), info.n_rot, n_positions)
    # llama.cpp divides each angle by its factor: the factor is the ratio of the plain to the scaled frequency
    return plain_keys("none"), {TENSORS["freqs"]: (plain / scaled).astype(np.float32)}

def longrope_form(info: Any, params: dict, opts: dict, n_positions: int):
    if info.arch not in LONGROPE_ARCHS:
        raise ValueError(f"LongRoPE lives in rope_factors_long/short tensors, which llama.cpp's {info.arch} loader "
                         f"does not read (architectures that do: {', '.join(sorted(LONGROPE_ARCHS))})")
    for key in ("short_factor", "long_factor"):
        if len(params[key]) != info.n_rot // 2:
            raise ValueError(f"{key} must have one entry per rotary frequency: {info.n_rot // 2} for this model "
                             f"(rotary dim {info.n_rot}), got {len(params[key])}")
    _, attention = rope_numbers(params, info.n_rot, n_positions)
    # No rope.scaling.factor: llama.cpp would also divide every angle by it (freq_scale); the factors carry it all.
    keys = plain_keys("longrope", **{"rope.scaling.attn_factor": (attention, "f32")})
    return keys, {TENSORS["long"]: np.asarray(params["long_factor"], dtype=np.float32),
                  TENSORS["short"]: np.asarray(params["short_factor"], dtype=np.float32)}

def group_attention_flags(group_size: int, window: int) -> str:
    """llama.cpp's run-time form of Self-Extend (G = group_size, W = window)."""
    return f"--grp-attn-n {group_size} --grp-attn-w {window}"
