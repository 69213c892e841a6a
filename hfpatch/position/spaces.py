"""The search spaces of hfpatch's own schemes, which their records name (`search=`, position/registry.py):

- YaRN: its factor, beta_fast, beta_slow and attention_factor (`YARN`);
- LongRoPE: its per-pair rescale factors λ_i (θ'_i = θ_i / λ_i), one per rotary frequency pair, highest frequency
  first, with LongRoPE's constraint 1 <= λ_0 <= λ_1 <= ... (a lower frequency is never stretched less than a higher
  one), and an attention factor (`PER_PAIR`). Its starting points are the per-pair factors that the seed schemes
  (the records with `per_pair_seed`: PI, NTK, YaRN, llama3) put into the very model searched;
- Self-Extend: its group size G and neighbour window W (`SELF_EXTEND`);
- Dual Chunk Attention: its chunk_size and local_window (`DUAL_CHUNK`).
"""

from __future__ import annotations

import itertools
import math
import random

from .search_space import Constraint, Operators, Param, Space, Where, log_step


def yarn_attention(ratio: float) -> float:
    """YaRN's attention factor for an extension ratio s: 0.1 ln s + 1."""
    return 0.1 * math.log(ratio) + 1.0


# --------------------------------------------------------------------------------------------------------- yarn

YARN = Space(
    # the factor from half the ratio (at least 1.01, or the ratio itself when it is smaller) to twice it
    {"factor": Param(lambda s, p: min(s.ratio, max(1.01, s.ratio / 2)), lambda s, p: 2 * s.ratio, 0.2),
     "beta_fast": Param(2.0, 128.0, 0.2),
     "beta_slow": Param(0.25, 16.0, 0.2),
     "attention_factor": Param(lambda s, p: s.attention_range[0], lambda s, p: s.attention_range[1], 0.2)},
    # YaRN's published defaults, its attention factor 0.1 ln s + 1
    start=lambda s: {"factor": s.ratio, "beta_fast": 32.0, "beta_slow": 1.0,
                     "attention_factor": yarn_attention(s.ratio)},
    short=("factor", "beta_fast", "beta_slow", "attention_factor"),
    constraints=(Constraint(("beta_fast", "beta_slow"), lambda p: p["beta_fast"] > p["beta_slow"],
                            "beta_fast <= beta_slow"),),
    fixed=lambda s: {"original_max_position_embeddings": s.window})


# ----------------------------------------------------------------------------------------------- self-extend


def _self_extend_start(s: Where) -> dict:
    w = max(1, s.window // 8)  # Self-Extend's default neighbour window
    g = max(2, math.ceil((s.target - w) / (s.window - w)))  # the smallest group that reaches the target
    return {"group_size": g, "window": w}


SELF_EXTEND = Space(
    {"group_size": Param(2, lambda s, p: math.ceil(8 * s.ratio), 0.25, integer=True, weight=0.6),
     "window": Param(1, lambda s, p: s.window // 2, 0.4, integer=True, weight=0.4)},
    start=_self_extend_start, short=("group_size", "window"), moves="one")


# ------------------------------------------------------------------------------------------------ dual-chunk

DUAL_CHUNK = Space(
    {"chunk_size": Param(lambda s, p: max(2, s.window // 4), lambda s, p: s.window, 0.15, integer=True),
     "local_window": Param(1, lambda s, p: p["chunk_size"] // 2, 0.4, integer=True)},
    # Dual Chunk Attention's defaults: chunks of 3/4 of the window, a local window of 1/16
    start=lambda s: {"chunk_size": s.window * 3 // 4, "local_window": max(1, s.window // 16)},
    short=("chunk_size", "local_window"), moves="one")


# ----------------------------------------------------------------------------------------- per-pair factors

# Per-pair factors are searched in [1, FACTOR_CEILING x the extension ratio]: NTK's lowest frequency already
# stretches a little past the ratio; much more than twice it makes the far positions collide.
FACTOR_CEILING = 2.0


def monotone(factors: list[float]) -> bool:
    """LongRoPE's constraint: every factor >= 1, non-decreasing from the highest frequency to the lowest."""
    return all(f >= 1.0 for f in factors) and all(a <= b for a, b in itertools.pairwise(factors))


def project(factors: list[float], ceiling: float) -> list[float]:
    """The nearest factors that keep the constraint: clipped to [1, ceiling], then made non-decreasing."""
    out, low = [], 1.0
    for f in factors:
        low = min(max(f, low), ceiling)
        out.append(low)
    return out


def _per_pair_why(params: dict, s: Where) -> str | None:
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


def _per_pair_start(s: Where) -> list[dict]:
    return [{"from": name, "factors": list(f), "attention_factor": a} for name, (f, a) in s.seeds.items()]


def _per_pair_mutate(rng: random.Random, p: dict, s: Where) -> dict:
    """Each factor moved with probability 0.3 by a log-normal step; a draw that breaks the order is drawn again
    (LongRoPE keeps only candidates that meet the constraint), and after 20 tries the draw is projected onto it."""
    ceiling = FACTOR_CEILING * s.ratio
    for _ in range(20):
        f = [log_step(rng, x, 0.1, 1.0, ceiling) if rng.random() < 0.3 else x for x in p["factors"]]
        if monotone(f) and f != p["factors"]:
            break
    else:
        f = project(f, ceiling)
    a = p["attention_factor"]
    if rng.random() < 0.3:
        a = log_step(rng, a, 0.05, *s.attention_range)
    return {**p, "from": "mutation", "factors": f, "attention_factor": a}


def _per_pair_cross(rng: random.Random, a: dict, b: dict, s: Where) -> dict:
    """Each factor from one parent or the other; drawn again while the order breaks, then projected."""
    for _ in range(20):
        f = [x if rng.random() < 0.5 else y for x, y in zip(a["factors"], b["factors"])]
        if monotone(f):
            break
    else:
        f = project(f, FACTOR_CEILING * s.ratio)
    pick = a if rng.random() < 0.5 else b
    return {"from": "crossover", "factors": f, "attention_factor": pick["attention_factor"]}


def _per_pair_spec(p: dict, s: Where) -> dict:
    # short_factor all ones: up to the trained window the model keeps its own frequencies
    return {"factor": s.ratio, "original_max_position_embeddings": s.window, "short_factor": [1.0] * len(p["factors"]),
            "long_factor": list(p["factors"]), "attention_factor": p["attention_factor"]}


def _per_pair_label(p: dict) -> str:
    """Where the factors come from, the first and last factor, the attention factor."""
    f = p["factors"]
    return f"[{p['from']}] λ {f[0]:.3g}..{f[-1]:.3g} a={p['attention_factor']:.3g}"


# the short factors stay 1 (the model's own frequencies up to the window); the attention factor applies at every
# length
PER_PAIR = Operators(_per_pair_start, _per_pair_mutate, _per_pair_cross, _per_pair_why, _per_pair_spec,
                     short=("attention_factor",), needs_pairs=True, label=_per_pair_label)
