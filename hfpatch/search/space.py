"""What `hfpatch search` searches over: candidates, their constraints, and how new ones are made from old ones.

A candidate is a family (a record of FAMILIES, named after the position scheme it patches with) and its parameters
(plain JSON data), which `spec()` turns into the keyword arguments of `hfpatch.patch`:

- `longrope`: LongRoPE's per-pair rescale factors λ_i (θ'_i = θ_i / λ_i), one per rotary frequency pair, highest
  frequency first, with LongRoPE's constraint: 1 <= λ_0 <= λ_1 <= ... (a lower frequency is never stretched less
  than a higher one), and an attention factor. The starting points are the per-pair factors that PI, NTK, YaRN and
  llama3 put into this very model, read off its rotary module after hfpatch's own builders and transformers' init
  functions computed them (`seeds`): each starting candidate reproduces that scheme past the window.
- `yarn`: YaRN's factor, beta_fast, beta_slow and attention_factor;
- `self-extend`: Self-Extend's group size G and neighbour window W;
- `dual-chunk`: Dual Chunk Attention's chunk_size and local_window.

Every family also carries an attention-temperature gene (none, logn or llama4: hfpatch's `attention_temperature`).
New candidates come from mutation (each gene moved by a random log-normal step, the constraints kept) and, within a
family, crossover (each gene from one of two parents), as LongRoPE's evolutionary search makes them.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..adapters import adapter_for
from ..apply import unwrap
from ..evaluate.common import applied
from ..position.registry import unavailable
from ..position.signal import rotaries_of
from .options import FAMILY_NAMES

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# The schemes whose per-pair factors start the LongRoPE population (each at factor = target / window).
SEED_SCHEMES = ("linear", "ntk", "yarn", "llama3")
TEMPERATURES = (None, "logn", "llama4")
# Per-pair factors are searched in [1, FACTOR_CEILING x the extension ratio]: NTK's lowest frequency already
# stretches a little past the ratio; much more than twice it makes the far positions collide.
FACTOR_CEILING = 2.0
ATTENTION_FACTOR = (0.8, 2.0)  # the attention factor's range (1: no scaling; YaRN's default is 0.1 ln s + 1)


@dataclass(frozen=True)
class Setting:
    """What candidates are built for: the trained window, the target length, the rotary pairs (None: no RoPE to
    rescale pair by pair) and LongRoPE's starting factors ({scheme: (factors, attention factor)})."""

    window: int
    target: int
    pairs: int | None = None
    seeds: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.target / self.window

    @property
    def attention_range(self) -> tuple[float, float]:
        """The attention factor's range: ATTENTION_FACTOR, widened to hold YaRN's default 0.1 ln s + 1 (above 2 past
        a ratio of e^10)."""
        return ATTENTION_FACTOR[0], max(ATTENTION_FACTOR[1], yarn_attention(self.ratio))


def yarn_attention(ratio: float) -> float:
    """YaRN's attention factor for an extension ratio s: 0.1 ln s + 1."""
    return 0.1 * math.log(ratio) + 1.0


def _log_step(rng: random.Random, value: float, sigma: float, low: float, high: float) -> float:
    return min(max(value * math.exp(rng.gauss(0.0, sigma)), low), high)


def _int_step(rng: random.Random, value: int, sigma: float, low: int, high: int) -> int:
    moved = round(value * math.exp(rng.gauss(0.0, sigma)))
    if moved == value:  # a step of less than one must still move
        moved = value + rng.choice((-1, 1))
    return min(max(moved, low), high)


def _temperature(rng: random.Random, params: dict) -> dict:
    """The attention-temperature gene moved with probability 1/4."""
    if rng.random() < 0.25:
        return {**params, "temperature": rng.choice([t for t in TEMPERATURES if t != params.get("temperature")])}
    return params


def _with_temperature(params: dict, spec: dict) -> dict:
    return {**spec, "attention_temperature": params["temperature"]} if params.get("temperature") else spec


# ----------------------------------------------------------------------------------------------------- longrope


def monotone(factors: list[float]) -> bool:
    """LongRoPE's constraint: every factor >= 1, non-decreasing from the highest frequency to the lowest."""
    return all(f >= 1.0 for f in factors) and all(a <= b for a, b in itertools.pairwise(factors))


def _longrope_why(params: dict, s: Setting) -> str | None:
    f = params["factors"]
    if len(f) != s.pairs:
        return f"{len(f)} factors for {s.pairs} rotary pairs"
    if not monotone(f):
        return "factors not >= 1 and non-decreasing from high to low frequency"
    if max(f) > FACTOR_CEILING * s.ratio * (1 + 1e-9):
        return f"a factor above {FACTOR_CEILING:g} x the extension ratio"
    low, high = s.attention_range
    if not low <= params["attention_factor"] <= high:
        return f"attention_factor outside [{low:g}, {high:g}]"
    return None


def _longrope_start(s: Setting) -> list[dict]:
    return [{"from": name, "factors": list(f), "attention_factor": a, "temperature": None}
            for name, (f, a) in s.seeds.items()]


def _project(factors: list[float], ceiling: float) -> list[float]:
    """The nearest factors that keep the constraint: clipped to [1, ceiling], then made non-decreasing."""
    out, low = [], 1.0
    for f in factors:
        low = min(max(f, low), ceiling)
        out.append(low)
    return out


def _longrope_mutate(rng: random.Random, p: dict, s: Setting) -> dict:
    """Each factor moved with probability 0.3 by a log-normal step; a draw that breaks the order is drawn again
    (LongRoPE keeps only candidates that meet the constraint), and after 20 tries the draw is projected onto it."""
    ceiling = FACTOR_CEILING * s.ratio
    for _ in range(20):
        f = [_log_step(rng, x, 0.1, 1.0, ceiling) if rng.random() < 0.3 else x for x in p["factors"]]
        if monotone(f) and f != p["factors"]:
            break
    else:
        f = _project(f, ceiling)
    a = p["attention_factor"]
    if rng.random() < 0.3:
        a = _log_step(rng, a, 0.05, *s.attention_range)
    return _temperature(rng, {**p, "from": "mutation", "factors": f, "attention_factor": a})


def _longrope_cross(rng: random.Random, a: dict, b: dict, s: Setting) -> dict:
    """Each factor from one parent or the other; drawn again while the order breaks, then projected."""
    for _ in range(20):
        f = [x if rng.random() < 0.5 else y for x, y in zip(a["factors"], b["factors"])]
        if monotone(f):
            break
    else:
        f = _project(f, FACTOR_CEILING * s.ratio)
    pick = a if rng.random() < 0.5 else b
    return {"from": "crossover", "factors": f, "attention_factor": pick["attention_factor"],
            "temperature": (a if rng.random() < 0.5 else b).get("temperature")}


def _longrope_spec(p: dict, s: Setting) -> dict:
    # short_factor all ones: up to the trained window the model keeps its own frequencies
    return _with_temperature(p, {"position": "longrope", "factor": s.ratio, "original_max_position_embeddings":
                                 s.window, "short_factor": [1.0] * len(p["factors"]),
                                 "long_factor": list(p["factors"]), "attention_factor": p["attention_factor"]})


# --------------------------------------------------------------------------------------------------------- yarn

_BETAS = {"beta_fast": (2.0, 128.0), "beta_slow": (0.25, 16.0)}


def _yarn_ranges(s: Setting) -> dict:
    # the factor from half the ratio (at least 1.01, or the ratio itself when it is smaller) to twice it
    return {"factor": (min(s.ratio, max(1.01, s.ratio / 2)), 2 * s.ratio), **_BETAS,
            "attention_factor": s.attention_range}


def _yarn_why(p: dict, s: Setting) -> str | None:
    for k, (lo, hi) in _yarn_ranges(s).items():
        if not lo <= p[k] <= hi:
            return f"{k} = {p[k]:g} outside [{lo:g}, {hi:g}]"
    if p["beta_fast"] <= p["beta_slow"]:
        return "beta_fast <= beta_slow"
    return None


def _yarn_start(s: Setting) -> list[dict]:
    # YaRN's published defaults, its attention factor 0.1 ln s + 1
    return [{"from": "yarn", "factor": s.ratio, "beta_fast": 32.0, "beta_slow": 1.0,
             "attention_factor": yarn_attention(s.ratio), "temperature": None}]


def _yarn_mutate(rng: random.Random, p: dict, s: Setting) -> dict:
    ranges = _yarn_ranges(s)
    for _ in range(20):
        moved = {k: _log_step(rng, p[k], 0.2, *ranges[k]) if rng.random() < 0.5 else p[k] for k in ranges}
        if moved["beta_fast"] > moved["beta_slow"] and moved != {k: p[k] for k in ranges}:
            break
    else:
        moved = {k: p[k] for k in ranges}
    return _temperature(rng, {**p, **moved, "from": "mutation"})


def _mix(rng: random.Random, a: dict, b: dict, keys: Iterable[str]) -> dict:
    return {k: (a if rng.random() < 0.5 else b)[k] for k in keys}


def _yarn_cross(rng: random.Random, a: dict, b: dict, s: Setting) -> dict:
    child = {"from": "crossover", **_mix(rng, a, b, [*_yarn_ranges(s), "temperature"])}
    if child["beta_fast"] <= child["beta_slow"]:  # the betas of one parent always hold
        child.update(_mix(rng, a, a, ("beta_fast", "beta_slow")))
    return child


def _yarn_spec(p: dict, s: Setting) -> dict:
    return _with_temperature(p, {"position": "yarn", "original_max_position_embeddings": s.window,
                                 **{k: p[k] for k in _yarn_ranges(s)}})


# ----------------------------------------------------------------------------------------------- self-extend


def _self_extend_reach(group: int, neighbours: int, window: int) -> int:
    """The farthest distance Self-Extend keeps inside the trained positions: (window - W) x G + W."""
    return (window - neighbours) * group + neighbours


def _self_extend_why(p: dict, s: Setting) -> str | None:
    if not 1 <= p["window"] <= s.window // 2:
        return f"window = {p['window']} outside [1, {s.window // 2}]"
    if not 2 <= p["group_size"] <= math.ceil(8 * s.ratio):
        return f"group_size = {p['group_size']} outside [2, {math.ceil(8 * s.ratio)}]"
    return None


def _self_extend_start(s: Setting) -> list[dict]:
    w = max(1, s.window // 8)  # Self-Extend's default neighbour window
    g = max(2, math.ceil((s.target - w) / (s.window - w)))  # the smallest group that reaches the target
    return [{"from": "self-extend", "group_size": g, "window": w, "temperature": None}]


def _self_extend_mutate(rng: random.Random, p: dict, s: Setting) -> dict:
    g, w = p["group_size"], p["window"]
    if rng.random() < 0.6:
        g = _int_step(rng, g, 0.25, 2, math.ceil(8 * s.ratio))
    else:
        w = _int_step(rng, w, 0.4, 1, s.window // 2)
    return _temperature(rng, {**p, "from": "mutation", "group_size": g, "window": w})


def _self_extend_cross(rng: random.Random, a: dict, b: dict, s: Setting) -> dict:
    return {"from": "crossover", **_mix(rng, a, b, ("group_size", "window", "temperature"))}


def _self_extend_spec(p: dict, s: Setting) -> dict:
    return _with_temperature(p, {"position": "self-extend", "group_size": p["group_size"], "window": p["window"]})


# ------------------------------------------------------------------------------------------------ dual-chunk


def _dual_chunk_why(p: dict, s: Setting) -> str | None:
    if not max(2, s.window // 4) <= p["chunk_size"] <= s.window:
        return f"chunk_size = {p['chunk_size']} outside [{max(2, s.window // 4)}, {s.window}]"
    if not 1 <= p["local_window"] <= p["chunk_size"] // 2:
        return f"local_window = {p['local_window']} outside [1, chunk_size / 2]"
    return None


def _dual_chunk_start(s: Setting) -> list[dict]:
    # Dual Chunk Attention's defaults: chunks of 3/4 of the window, a local window of 1/16
    return [{"from": "dual-chunk", "chunk_size": s.window * 3 // 4, "local_window": max(1, s.window // 16),
             "temperature": None}]


def _dual_chunk_mutate(rng: random.Random, p: dict, s: Setting) -> dict:
    c, w = p["chunk_size"], p["local_window"]
    if rng.random() < 0.5:
        c = _int_step(rng, c, 0.15, max(2, s.window // 4), s.window)
    else:
        w = _int_step(rng, w, 0.4, 1, c // 2)
    return _temperature(rng, {**p, "from": "mutation", "chunk_size": c, "local_window": min(w, c // 2)})


def _dual_chunk_cross(rng: random.Random, a: dict, b: dict, s: Setting) -> dict:
    child = {"from": "crossover", **_mix(rng, a, b, ("chunk_size", "local_window", "temperature"))}
    child["local_window"] = min(child["local_window"], child["chunk_size"] // 2)
    return child


def _dual_chunk_spec(p: dict, s: Setting) -> dict:
    return _with_temperature(p, {"position": "dual-chunk", "chunk_size": p["chunk_size"],
                                 "local_window": p["local_window"]})


# --------------------------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Family:
    start: Callable[[Setting], list[dict]]  # the starting candidates' parameters
    mutate: Callable[[random.Random, dict, Setting], dict]
    cross: Callable[[random.Random, dict, dict, Setting], dict]
    why_not: Callable[[dict, Setting], str | None]  # which constraint the parameters break (None: they hold)
    spec: Callable[[dict, Setting], dict]  # the keyword arguments of hfpatch.patch
    # the parameters that decide what the patched model does within its trained window: candidates that agree on
    # them read the guard's text alike, so the guard is read once for them (the attention temperature is never
    # among them: it scales no query inside the window)
    short: tuple[str, ...]
    needs_pairs: bool = False  # needs a rotary module with one flat inv_freq (per-pair factors)

    def short_key(self, params: dict) -> dict:
        return {k: params[k] for k in self.short}


FAMILIES: dict[str, Family] = {
    # the short factors stay 1 (the model's own frequencies up to the window); the attention factor applies at
    # every length
    "longrope": Family(_longrope_start, _longrope_mutate, _longrope_cross, _longrope_why, _longrope_spec,
                       short=("attention_factor",), needs_pairs=True),
    "yarn": Family(_yarn_start, _yarn_mutate, _yarn_cross, _yarn_why, _yarn_spec,
                   short=("factor", "beta_fast", "beta_slow", "attention_factor")),
    "self-extend": Family(_self_extend_start, _self_extend_mutate, _self_extend_cross, _self_extend_why,
                          _self_extend_spec, short=("group_size", "window")),
    "dual-chunk": Family(_dual_chunk_start, _dual_chunk_mutate, _dual_chunk_cross, _dual_chunk_why,
                         _dual_chunk_spec, short=("chunk_size", "local_window")),
}
assert tuple(FAMILIES) == FAMILY_NAMES  # options.py declares the names for the command line, without torch


def _rotary_frequencies(model: PreTrainedModel):
    """The flat inv_freq buffer and attention scaling of the model's first rotary module, None where there is none
    (no RoPE, or RoPE nested per layer type)."""
    target = unwrap(model)
    adapter = adapter_for(target)
    if not adapter.has_rope:
        return None
    rotary, _ = rotaries_of(target, adapter)[0]
    inv_freq = getattr(rotary, "inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dim() != 1:
        return None
    return inv_freq.detach().double().clone(), float(getattr(rotary, "attention_scaling", 1.0))


def per_pair_factors(model: PreTrainedModel, kwargs: dict) -> tuple[list[float], float]:
    """(λ_i = θ_i / θ'_i for every rotary pair, the attention scaling) of the patch `kwargs` on this model: read
    off its rotary module with the patch applied, against plain RoPE at the original theta."""
    with applied(model, {"position": "rope"}, "rope"):
        base = _rotary_frequencies(model)
    with applied(model, kwargs, kwargs["position"]):
        scaled = _rotary_frequencies(model)
    if base is None or scaled is None:
        raise ValueError("the model has no rotary module with one frequency per pair")
    factors = (base[0] / scaled[0]).tolist()
    # a float's last bit can make a constant factor (PI) look decreasing: the constraint is on the scheme, not the
    # rounding
    return _project([round(f, 9) for f in factors], math.inf), scaled[1]


def setting_for(model: PreTrainedModel, window: int, target: int, families: list[str]) -> tuple[Setting,
                dict[str, str]]:
    """The Setting of `model`, and {family: why it is left out} for the families that do not apply to it."""
    target_model = unwrap(model)
    adapter = adapter_for(target_model)
    left_out: dict[str, str] = {}
    for name in families:
        why = unavailable(name, adapter)
        if why:
            left_out[name] = why
    pairs, seeds = None, {}
    freqs = _rotary_frequencies(model) if adapter.has_rope else None
    if freqs is not None:
        pairs = freqs[0].numel()
        ratio = target / window
        for scheme in SEED_SCHEMES:
            seeds[scheme] = per_pair_factors(model, {"position": scheme, "factor": ratio,
                                                     "original_max_position_embeddings": window})
    for name in families:
        if FAMILIES[name].needs_pairs and pairs is None and name not in left_out:
            left_out[name] = "the model has no rotary module with one frequency per pair (RoPE per layer type)"
    return Setting(window, target, pairs, seeds), left_out


def why_not(family: str, params: dict, s: Setting) -> str | None:
    return FAMILIES[family].why_not(params, s)


def spec(family: str, params: dict, s: Setting) -> dict:
    return FAMILIES[family].spec(params, s)
