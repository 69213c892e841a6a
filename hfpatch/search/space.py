"""What `hfpatch search` searches over: candidates, their constraints, and how new ones are made from old ones.

A candidate is a family and its parameters (plain JSON data), which `spec()` turns into the keyword arguments of
`hfpatch.patch`. A family is a position scheme whose record declares a search space (`search=`, position/registry.py;
the spaces of hfpatch's own schemes are in position/spaces.py), named after it:

- `longrope`: LongRoPE's per-pair rescale factors and an attention factor (its record's own `Operators`), starting
  from the per-pair factors that the seed schemes (the records with `per_pair_seed`: linear, ntk, yarn, llama3) put
  into this very model, read off its rotary module after hfpatch's own builders and transformers' init functions
  computed them (`per_pair_factors`): each starting candidate reproduces that scheme past the window;
- `yarn`, `self-extend`, `dual-chunk` and any scheme registered with a `Space`: the options it declares, each moved
  by a random log-normal step within its range, the space's constraints kept.

Every family also carries an attention-temperature gene (none, logn or llama4: hfpatch's `attention_temperature`).
New candidates come from mutation and, within a family, crossover (each gene from one of two parents), as LongRoPE's
evolutionary search makes them. The families are those of options.FAMILY_NAMES first, in that order, then the other
schemes that declare a search space, in registry order (options.families_offered).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..adapters import adapter_for
from ..apply import unwrap
from ..evaluate.common import applied
from ..position.registry import SCHEMES, unavailable
from ..position.rope.rotary import rotaries_of
from ..position.search_space import Operators, Param, Space, int_step, log_step
from ..position.spaces import monotone as monotone  # importable from here too
from ..position.spaces import project, yarn_attention
from ..registry import Derived
from .options import FAMILY_NAMES, families_offered

if TYPE_CHECKING:
    from transformers import PreTrainedModel

TEMPERATURES = (None, "logn", "llama4")
ATTENTION_FACTOR = (0.8, 2.0)  # the attention factor's range (1: no scaling; YaRN's default is 0.1 ln s + 1)


@dataclass(frozen=True)
class Setting:
    """What candidates are built for: the trained window, the target length, the rotary pairs (None: no RoPE to
    rescale pair by pair) and the per-pair family's starting factors ({scheme: (factors, attention factor)})."""

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


def seed_schemes() -> list[str]:
    """The schemes whose per-pair factors start the per-pair family's population (each at factor = target / window):
    those whose record says so (`per_pair_seed`), in registry order."""
    return [name for name, scheme in SCHEMES.items() if scheme.per_pair_seed]


def _temperature(rng: random.Random, params: dict) -> dict:
    """The attention-temperature gene moved with probability 1/4."""
    if rng.random() < 0.25:
        return {**params, "temperature": rng.choice([t for t in TEMPERATURES if t != params.get("temperature")])}
    return params


def _with_temperature(params: dict, spec: dict) -> dict:
    return {**spec, "attention_temperature": params["temperature"]} if params.get("temperature") else spec


def _mix(rng: random.Random, a: dict, b: dict, keys: Iterable[str]) -> dict:
    return {k: (a if rng.random() < 0.5 else b)[k] for k in keys}


# ------------------------------------------------------------------------------------------ a declared space


def _text(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _space_why(space: Space, p: dict, s: Setting) -> str | None:
    for name, param in space.params.items():
        low, high = param.bounds(s, p)
        if not low <= p[name] <= high:
            return f"{name} = {_text(p[name])} outside [{_text(low)}, {_text(high)}]"
    for constraint in space.constraints:
        if not constraint.holds(p):
            return constraint.broken
    return None


def _step(rng: random.Random, param: Param, value: float, s: Setting, p: dict) -> float:
    low, high = param.bounds(s, p)
    if param.integer:
        return int_step(rng, int(value), param.sigma, int(low), int(high))
    return log_step(rng, value, param.sigma, low, high)


def _clamped(space: Space, p: dict, s: Setting) -> dict:
    """`p` with every parameter within its range (a range that follows another parameter: Dual Chunk's local window
    within half the chunk)."""
    out = dict(p)
    for name, param in space.params.items():
        low, high = param.bounds(s, out)
        out[name] = min(max(out[name], low), high)
    return out


def _space_mutate(space: Space, rng: random.Random, p: dict, s: Setting) -> dict:
    keys = list(space.params)
    if space.moves == "one":  # one parameter, drawn by weight
        r, chosen, total = rng.random(), keys[-1], 0.0
        for name in keys[:-1]:
            total += space.params[name].weight
            if r < total:
                chosen = name
                break
        moved = {chosen: _step(rng, space.params[chosen], p[chosen], s, p)}
    else:  # each parameter with its probability, drawn again while a constraint breaks or nothing moved
        unmoved = {k: p[k] for k in keys}
        for _ in range(20):
            moved = {k: _step(rng, space.params[k], p[k], s, p) if rng.random() < space.params[k].weight else p[k]
                     for k in keys}
            if all(c.holds(moved) for c in space.constraints) and moved != unmoved:
                break
        else:
            moved = unmoved
    return _temperature(rng, _clamped(space, {**p, "from": "mutation", **moved}, s))


def _space_cross(space: Space, rng: random.Random, a: dict, b: dict, s: Setting) -> dict:
    child = {"from": "crossover", **_mix(rng, a, b, [*space.params, "temperature"])}
    for constraint in space.constraints:
        if not constraint.holds(child):  # the parameters of one parent always hold
            child.update(_mix(rng, a, a, constraint.params))
    return _clamped(space, child, s)


def _space_family(name: str, space: Space) -> Family:
    def start(s: Setting) -> list[dict]:
        return [{"from": name, **space.start(s), "temperature": None}]

    def spec(p: dict, s: Setting) -> dict:
        fixed = space.fixed(s) if space.fixed is not None else {}
        return _with_temperature(p, {"position": name, **fixed, **{k: p[k] for k in space.params}})

    return Family(start, lambda rng, p, s: _space_mutate(space, rng, p, s),
                  lambda rng, a, b, s: _space_cross(space, rng, a, b, s), lambda p, s: _space_why(space, p, s),
                  spec, short=space.short)


def _operators_family(name: str, ops: Operators) -> Family:
    def start(s: Setting) -> list[dict]:
        return [{**p, "temperature": None} for p in ops.start(s)]

    def cross(rng: random.Random, a: dict, b: dict, s: Setting) -> dict:
        child = ops.cross(rng, a, b, s)
        return {**child, "temperature": (a if rng.random() < 0.5 else b).get("temperature")}

    return Family(start, lambda rng, p, s: _temperature(rng, ops.mutate(rng, p, s)), cross, ops.why_not,
                  lambda p, s: _with_temperature(p, {"position": name, **ops.spec(p, s)}), short=ops.short,
                  needs_pairs=ops.needs_pairs, label=ops.label)


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
    label: Callable[[dict], str] | None = None  # a candidate in a few words after the name (None: its spec)

    def short_key(self, params: dict) -> dict:
        return {k: params[k] for k in self.short}


_BUILT: dict[str, Family] = {}  # a record never changes once registered: its family is built once


def _family(name: str) -> Family:
    if name not in _BUILT:
        declared = SCHEMES[name].search
        if declared is None:
            raise ValueError(f"position={name!r} declares no search space (its record's search=)")
        _BUILT[name] = (_operators_family(name, declared) if isinstance(declared, Operators)
                        else _space_family(name, declared))
    return _BUILT[name]


# The families, from the scheme records that declare a search space: FAMILY_NAMES first (options.py declares them for
# the command line, without torch), then the others in registry order
FAMILIES: Derived[Family] = Derived(lambda: {name: _family(name) for name in families_offered()})
assert all(SCHEMES[name].search is not None for name in FAMILY_NAMES), "every declared family has its record's space"


def _rotary_frequencies(model: PreTrainedModel) -> tuple[torch.Tensor, float] | None:
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
    return project([round(f, 9) for f in factors], math.inf), scaled[1]


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
        for scheme in seed_schemes():
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
