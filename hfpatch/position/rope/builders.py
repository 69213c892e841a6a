"""RoPE schemes as small pure functions over plain data.

Each builder takes the model's original RoPE parameters for one layer type (`base`: a transformers
`rope_parameters` dict with at least `rope_theta`), the trained window and the user's options, and returns the
`rope_parameters` dict that describes the scheme in transformers' own vocabulary. The inverse frequencies themselves
are then computed by transformers' `ROPE_INIT_FUNCTIONS` (or the rotary class's default), exactly as a natively
configured model computes them: we do not re-implement what transformers already does.

Two schemes have no native rope_type:
- `ntk` (NTK-aware, static): the base change b' = b * s^(d/(d-2)) *is* plain RoPE with another theta, so it is
  written as `rope_type="default"` with the new theta, and stays native;
- `dynamic-yarn`: YaRN whose scale follows the current length, s = max(1, L / L_orig). It is recomputed by
  `position.rotary.DynamicYarnRotary` through `yarn_parameters_at`.
"""

from __future__ import annotations

# Keys of rope_parameters that describe a scaling scheme; every other key describes the model (rope_theta,
# partial_rotary_factor, mrope_section, llama_4_scaling_beta, ...) and carries over to the new parameters.
_SCHEME_KEYS = ("rope_type", "type", "factor", "original_max_position_embeddings", "max_position_embeddings",
                "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate",
                "low_freq_factor", "high_freq_factor", "short_factor", "long_factor", "short_mscale", "long_mscale")

YARN_OPTIONS = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")


def _carry(base: dict) -> dict:
    return {k: v for k, v in base.items() if k not in _SCHEME_KEYS}


def plain(base: dict, window: int, opts: dict, dim: int) -> dict:
    return {"rope_type": "default", **_carry(base)}


def linear(base: dict, window: int, opts: dict, dim: int) -> dict:
    """Position interpolation (Chen et al. 2023): positions divided by s."""
    return {"rope_type": "linear", **_carry(base), "factor": opts["factor"]}


def ntk_theta(theta: float, factor: float, dim: int) -> float:
    """NTK-aware base change (bloc97, 2023): b' = b * s^(d / (d - 2)), d = rotated channels."""
    return theta * factor ** (dim / (dim - 2))


def ntk(base: dict, window: int, opts: dict, dim: int) -> dict:
    out = {"rope_type": "default", **_carry(base)}
    out["rope_theta"] = ntk_theta(base["rope_theta"], opts["factor"], dim)
    return out


def dynamic(base: dict, window: int, opts: dict, dim: int) -> dict:
    """Dynamic NTK (emozilla): b' = b * (s*L/L_orig - (s-1))^(d/(d-2)) once L > L_orig. Without a factor, s = 1:
    the base grows exactly as NTK-aware scaling by L/L_orig."""
    return {"rope_type": "dynamic", **_carry(base), "factor": float(opts.get("factor", 1.0))}


def yarn(base: dict, window: int, opts: dict, dim: int) -> dict:
    out = {"rope_type": "yarn", **_carry(base), "factor": opts["factor"], "original_max_position_embeddings": window}
    out.update({k: opts[k] for k in YARN_OPTIONS if k in opts})
    return out


def llama3(base: dict, window: int, opts: dict, dim: int) -> dict:
    return {
        "rope_type": "llama3",
        **_carry(base),
        "factor": opts["factor"],
        "original_max_position_embeddings": window,
        # Llama 3.1's published values.
        "low_freq_factor": opts.get("low_freq_factor", 1.0),
        "high_freq_factor": opts.get("high_freq_factor", 4.0),
    }


def longrope(base: dict, window: int, opts: dict, dim: int) -> dict:
    out = {
        "rope_type": "longrope",
        **_carry(base),
        "factor": opts["factor"],
        "original_max_position_embeddings": window,
        "short_factor": [float(x) for x in opts["short_factor"]],
        "long_factor": [float(x) for x in opts["long_factor"]],
    }
    if "attention_factor" in opts:
        out["attention_factor"] = opts["attention_factor"]
    return out


def kept_pairs(keep: float, pairs: int) -> int:
    """p-RoPE: how many of `pairs` rotary frequency pairs stay rotated — the highest-frequency floor(keep * pairs),
    as transformers' "proportional" RoPE counts them."""
    return int(keep * pairs)


def p_rope_is_native(base: dict) -> bool:
    """Whether transformers' "proportional" RoPE expresses p-RoPE for a layer type with these parameters: only where
    every channel rotates (it counts frequencies over the whole head)."""
    return base.get("partial_rotary_factor", 1.0) == 1.0


def p_rope(base: dict, window: int, opts: dict, dim: int) -> dict:
    """p-RoPE (Barbero et al. 2025, "Round and round we go"): only the highest-frequency fraction `keep` of the
    rotary pairs rotates; the others get frequency 0 (cos 1, sin 0), so they carry no position. On a model that
    rotates every channel with plain RoPE this is transformers' own "proportional" rope_type with
    partial_rotary_factor = keep. A partial rotation (partial_rotary_factor < 1) has no native form: its own
    frequencies are kept and the low ones zeroed on the live rotary module (position.patch.keep_high_frequencies).
    Like `plain`, it starts from RoPE at the original theta (a checkpoint's own scaling is dropped)."""
    if not p_rope_is_native(base):
        return plain(base, window, opts, dim)
    return {"rope_type": "proportional", **_carry(base), "partial_rotary_factor": opts.get("keep", 0.75)}


def dynamic_yarn_scale(seq_len: int, window: int, cap: float | None = None) -> float:
    """YaRN paper §3.3, dynamic scaling: s = max(1, L / L_orig), optionally capped at `cap`."""
    s = max(1.0, seq_len / window)
    return min(s, cap) if cap is not None else s


def dynamic_yarn(base: dict, window: int, opts: dict, dim: int) -> dict:
    """The parameters at the start (L <= L_orig): plain RoPE. `yarn_parameters_at` gives those for a length."""
    return plain(base, window, opts, dim)


def yarn_parameters_at(base: dict, window: int, opts: dict, seq_len: int) -> dict:
    """rope_parameters of dynamic YaRN for a sequence of `seq_len` tokens (plain RoPE while s == 1: the paper's
    formula reduces to it, and using it avoids a rounding difference)."""
    s = dynamic_yarn_scale(seq_len, window, opts.get("factor"))
    if s == 1.0:
        return plain(base, window, opts, 0)
    return yarn(base, window, {**opts, "factor": s}, 0)
