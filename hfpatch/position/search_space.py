"""What `hfpatch search` may vary of a position scheme, as data its record carries (`search=`, position/registry.py);
hfpatch/search/space.py builds a search family from each record that declares one.

- `Space`: searched options as data — each a `Param` with its range (numbers, or functions of the search's setting
  and of the other parameters) and the width of its log-normal mutation step; the starting point; the options the
  spec fixes (the trained window); constraints across options; which options decide what the patched model does
  within its trained window (`short`). The search mutates, crosses and checks every `Space` the same way.
- `Operators`: a family whose candidates are more than a few options (LongRoPE's per-pair factors): its own small
  record of functions, for the search to call.

A record may also say that its per-pair factors start the per-pair family's population (`per_pair_seed`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class Where(Protocol):
    """What the ranges are computed from: the search's setting (hfpatch.search.space.Setting)."""

    @property
    def window(self) -> int: ...  # the trained window

    @property
    def target(self) -> int: ...  # the target length

    @property
    def pairs(self) -> int | None: ...  # the model's rotary pairs (None: no RoPE to rescale pair by pair)

    @property
    def seeds(self) -> dict: ...  # {scheme: (per-pair factors, attention factor)} of the seed schemes

    @property
    def ratio(self) -> float: ...  # target / window

    @property
    def attention_range(self) -> tuple[float, float]: ...  # the range of an attention factor


Bound = float | Callable[[Where, dict], float]  # a number, or (setting, the candidate's parameters) -> a number


@dataclass(frozen=True)
class Param:
    """One searched option: its range [low, high], the width of its log-normal mutation step, whether it is an
    integer, and its weight (the probability it moves in a mutation that moves each parameter, or its share of the
    mutations that move one)."""

    low: Bound
    high: Bound
    sigma: float
    integer: bool = False
    weight: float = 0.5

    def bounds(self, where: Where, params: dict) -> tuple[float, float]:
        low = self.low(where, params) if callable(self.low) else self.low
        high = self.high(where, params) if callable(self.high) else self.high
        return low, high


@dataclass(frozen=True)
class Constraint:
    """A condition across parameters, and what breaking it reads as. A child of a crossover that breaks it takes
    these parameters from its first parent."""

    params: tuple[str, ...]
    holds: Callable[[dict], bool]
    broken: str


@dataclass(frozen=True)
class Space:
    """A scheme's searched options. `moves`: "each" (every parameter moves with its weight's probability, drawn
    again while a constraint breaks or nothing moved) or "one" (one parameter, drawn by weight)."""

    params: dict[str, Param]
    start: Callable[[Where], dict]  # the starting candidate's parameters
    short: tuple[str, ...]  # the parameters that decide what the patched model does within its trained window
    moves: str = "each"
    constraints: tuple[Constraint, ...] = ()
    fixed: Callable[[Where], dict] | None = None  # options of the spec that are not searched

    def __post_init__(self) -> None:
        if self.moves not in ("each", "one"):
            raise ValueError(f"a search space's moves are 'each' or 'one', got {self.moves!r}")
        unknown = sorted(set(self.short) - set(self.params))
        if unknown:
            raise ValueError(f"a search space's short parameters must be searched ones: {', '.join(unknown)} are not")


@dataclass(frozen=True)
class Operators:
    """A family's own functions, over parameters of its own (no temperature gene: the search adds it): the starting
    candidates, a mutation, a crossover, which constraint parameters break (None: they hold), the spec's options
    (without `position`), the parameters that decide what the model does within its window, and whether it needs a
    rotary module with one flat inv_freq."""

    start: Callable[[Where], list[dict]]
    mutate: Callable[[random.Random, dict, Where], dict]
    cross: Callable[[random.Random, dict, dict, Where], dict]
    why_not: Callable[[dict, Where], str | None]
    spec: Callable[[dict, Where], dict]
    short: tuple[str, ...]
    needs_pairs: bool = False
    # a candidate in a few words, after the family's name (None: its spec's options)
    label: Callable[[dict], str] | None = None


def log_step(rng: random.Random, value: float, sigma: float, low: float, high: float) -> float:
    return min(max(value * math.exp(rng.gauss(0.0, sigma)), low), high)


def int_step(rng: random.Random, value: int, sigma: float, low: int, high: int) -> int:
    moved = round(value * math.exp(rng.gauss(0.0, sigma)))
    if moved == value:  # a step of less than one must still move
        moved = value + rng.choice((-1, 1))
    return min(max(moved, low), high)
