"""llama.cpp's RoPE metadata for each RoPE scheme hfpatch has, both ways: which keys and tensors carry it, computed
from the same rope_parameters `hfpatch.patch` builds (position/rope/builders.py) and transformers' RoPE functions,
and how a file's metadata reads back as the scheme. Pure functions of numbers (no GGUF file is read or written
here): each scheme record (position/registry.py) names its `Gguf` forms, and interop/gguf.py writes and reads them.

A writing form takes (info: what the GGUF says of its RoPE — arch, n_rot —, the scheme's rope_parameters, the
options, the extended window) and returns (metadata keys without the "{arch}." prefix: {key: (value, type)},
{tensor: float32 array}), or raises ValueError saying why this architecture's llama.cpp loader cannot carry it.

A reading form takes the file's RoPE (interop/gguf.py's RopeInfo: arch, freq_base, context_length, window, n_rot,
the scaling `keys` present, the RoPE `tensors` present) and returns the patch's options (the keyword arguments of
`hfpatch.patch` but `position`), {} when the file is in this form but carries no scaling (read as plain RoPE), or
None when the file is not in this form. A file's rope.scaling.type names its scaling: the readers of that type are
tried first, then those that read tensors whatever the type (`Gguf.scaling_type` None: Llama 3.1's rope_freqs,
which converters write without a type).

Read off llama.cpp's source (src/llama-model.cpp, src/llama-context.cpp, src/models/*.cpp) as vendored by
llama-cpp-python 0.3.36.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
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

DEFAULT_SCALING_TYPE = "linear"  # llama.cpp's reading of a file that names no rope.scaling.type


@dataclass(frozen=True)
class Gguf:
    """A scheme's GGUF forms: `write` (info, rope_parameters, options, extended window) -> (keys, tensors), `read`
    (the file's RoPE) -> the patch's options, {} or None (see above), and the rope.scaling.type it writes and reads
    (None: its reader reads tensors whatever the type)."""

    write: Callable[[Any, dict, dict, int], tuple[dict, dict]]
    read: Callable[[Any], dict | None] | None = None
    scaling_type: str | None = None


@dataclass(frozen=True)
class Refusal:
    """Why a GGUF cannot carry a scheme whose reason names settings that follow the request: `general` without a
    request, `given(request, trained window)` with one."""

    general: str
    given: Callable[[dict, int], str]


def rope_numbers(params: dict, n_rot: int, n_positions: int) -> tuple[np.ndarray, float]:
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

def rope_form(info: Any, params: dict, opts: dict, n_positions: int) -> tuple[dict, dict]:
    return plain_keys("none"), {}

def linear_form(info: Any, params: dict, opts: dict, n_positions: int) -> tuple[dict, dict]:
    return plain_keys("linear", **{"rope.scaling.factor": (params["factor"], "f32")}), {}

def ntk_form(info: Any, params: dict, opts: dict, n_positions: int) -> tuple[dict, dict]:
    return plain_keys("none"), {}  # the raised base is the plan's rope.freq_base

def yarn_form(info: Any, params: dict, opts: dict, n_positions: int) -> tuple[dict, dict]:
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

def llama3_form(info: Any, params: dict, opts: dict, n_positions: int) -> tuple[dict, dict]:
    if info.arch not in ROPE_FREQS_ARCHS:
        raise ValueError(f"llama3 scaling lives in a rope_freqs tensor, which llama.cpp's {info.arch} loader does not "
                         f"read (architectures that do: {', '.join(sorted(ROPE_FREQS_ARCHS))})")
    scaled, _ = rope_numbers(params, info.n_rot, n_positions)
    plain, _ = rope_numbers(builders.plain(params, 0, {}, 0), info.n_rot, n_positions)
    # llama.cpp divides each angle by its factor: the factor is the ratio of the plain to the scaled frequency
    return plain_keys("none"), {TENSORS["freqs"]: (plain / scaled).astype(np.float32)}

def longrope_form(info: Any, params: dict, opts: dict, n_positions: int) -> tuple[dict, dict]:
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


# ------------------------------------------------------------------------------------------------- reading back

def scaling_factor(info: Any) -> float:
    """The scaling factor a file names (rope.scaling.factor, else the older rope.scale_linear), 0 where none."""
    return info.keys.get("rope.scaling.factor") or info.keys.get("rope.scale_linear") or 0.0


def carries_rope_freqs(info: Any) -> bool:
    """Whether the file has a rope_freqs tensor that its architecture's llama.cpp loader reads."""
    return TENSORS["freqs"] in info.tensors and info.arch in ROPE_FREQS_ARCHS


def read_linear(info: Any) -> dict | None:
    """Position interpolation: a factor above 1, and no rope_freqs tensor the architecture reads (a file with one
    is Llama 3.1's scaling)."""
    factor = scaling_factor(info)
    if factor <= 1 or carries_rope_freqs(info):
        return None
    return {"factor": float(factor), "original_max_position_embeddings": info.window}


def read_yarn(info: Any) -> dict | None:
    k = info.keys
    factor = scaling_factor(info)
    if factor <= 1:
        return None
    if k.get("rope.scaling.yarn_ext_factor", 1.0) != 1.0:
        warnings.warn(f"yarn_ext_factor={k['rope.scaling.yarn_ext_factor']} has no transformers form; read as 1",
                      stacklevel=4)
    attn = k.get("rope.scaling.attn_factor", 1.0)
    opts: dict[str, Any] = {"factor": float(factor), "original_max_position_embeddings": info.window}
    if not math.isclose(attn, 1.0, rel_tol=1e-6):
        opts["attention_factor"] = attn * (1.0 + 0.1 * math.log(factor))  # what llama.cpp multiplies the angles by
    if info.arch in YARN_BETA_ARCHS:
        for name, default in YARN_BETA_DEFAULTS.items():
            value = k.get(f"rope.scaling.yarn_{name}")
            if value is not None and value != default:
                opts[name] = float(value)
    return opts


def read_longrope(info: Any) -> dict | None:
    if TENSORS["long"] not in info.tensors or TENSORS["short"] not in info.tensors:
        return None
    ratio = info.context_length / info.window
    if ratio <= 1:
        warnings.warn(f"LongRoPE factors with a context length ({info.context_length}) no longer than the original "
                      f"window ({info.window}): read as plain RoPE", stacklevel=4)
        return {}
    return {"factor": ratio, "attention_factor": float(info.keys.get("rope.scaling.attn_factor", 1.0)),
            "long_factor": info.tensors[TENSORS["long"]].tolist(),
            "short_factor": info.tensors[TENSORS["short"]].tolist(), "original_max_position_embeddings": info.window}


def read_llama3(info: Any) -> dict | None:
    """Llama 3.1's parameters from a rope_freqs tensor (the converter writes no others): the largest divisor is the
    factor; the divisors between 1 and it follow 1/f = (1 - t)/s + t with t linear in 1/wavelength, which gives
    low/high_freq_factor for the window (Meta's convention low_freq_factor = 1 where the file names no window)."""
    if not carries_rope_freqs(info):
        return None
    freqs = info.tensors[TENSORS["freqs"]]
    s = float(freqs.max())
    plain, _ = rope_numbers({"rope_type": "default", "rope_theta": info.freq_base}, info.n_rot, info.window)
    u = plain / (2 * math.pi)  # 1 / wavelength
    mid = (freqs > 1 + 1e-6) & (freqs < s * (1 - 1e-6))
    if s <= 1 or mid.sum() < 2:
        warnings.warn("a rope_freqs tensor that does not follow Llama 3.1's formula: read as plain RoPE", stacklevel=4)
        return {}
    t = (1 / freqs[mid] - 1 / s) / (1 - 1 / s)
    alpha, beta = np.polyfit(u[mid], t, 1)  # t = window/(high-low) * u - low/(high-low)
    if "rope.scaling.original_context_length" in info.keys:
        window = info.window
        low = -beta * window / alpha
    else:
        low = 1.0
        window = -alpha / beta
    high = low + window / alpha
    return {"factor": s, "low_freq_factor": float(round(low, 6)), "high_freq_factor": float(round(high, 6)),
            "original_max_position_embeddings": round(window)}


# ---------------------------------------------------------------------------------------- the records' forms

PLAIN = Gguf(rope_form)
LINEAR = Gguf(linear_form, read_linear, "linear")
NTK = Gguf(ntk_form)  # the raised base reads as the model's own: no reader tells it apart
YARN = Gguf(yarn_form, read_yarn, "yarn")
LLAMA3 = Gguf(llama3_form, read_llama3)
LONGROPE = Gguf(longrope_form, read_longrope, "longrope")
