"""Checks of numeric keyword arguments, shared by the scheme records (registry.py) and the attention temperatures
(attention/temperature.py): each takes (name, value) and returns the normalized value, or raises one TypeError or
ValueError saying what was wrong and what is accepted."""

from __future__ import annotations

import math
import numbers
from typing import Any


def number(name: str, value: Any, *, positive: bool = True, above_one: bool = False, at_most: float | None = None,
           why: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    try:
        value = float(value)
    except OverflowError:  # an integer too large for a float
        value = math.inf
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if above_one and value <= 1.0:
        raise ValueError(f"{name} must be > 1 (it is the context extension ratio), got {value:g}")
    if positive and value <= 0.0:
        raise ValueError(f"{name} must be > 0, got {value:g}")
    if at_most is not None and value > at_most:
        raise ValueError(f"{name} must be at most {at_most:g}{f' ({why})' if why else ''}, got {value:g}")
    return value


def positive_int(name: str, value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)
