"""What an evaluation reads from its command line, and how its numbers are written: lengths (2k, 1.5k), fractions
(needle depths), length labels, JSON-safe numbers. Pure Python, so that every evaluation module can import it at its
top and still answer `hfpatch eval NAME --help` without loading torch (common.py re-exports these names)."""

from __future__ import annotations

import math
import re


def parse_length(text: str) -> int:
    """'2k' = 2048, '1.5k' = 1536, '16384' = 16384 (k = 1024: trained windows are powers of two)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kK]?)\s*", text)
    if not m:
        raise ValueError(f"length {text!r} is not a number of tokens (e.g. 2048, 2k, 1.5k)")
    value = float(m.group(1)) * (1024 if m.group(2) else 1)
    if value != int(value) or value < 2:
        raise ValueError(f"length {text!r} must be a whole number of tokens >= 2")
    return int(value)


def parse_lengths(text: str) -> list[int]:
    lengths = [parse_length(t) for t in text.split(",") if t.strip()]
    if not lengths:
        raise ValueError("--lengths is empty")
    if len(set(lengths)) != len(lengths):
        raise ValueError(f"--lengths repeats a length: {text}")
    return sorted(lengths)


def length_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def parse_fractions(text: str, flag: str, meaning: str) -> list[float]:
    """'0,0.5,1' -> [0.0, 0.5, 1.0]: numbers in [0, 1], sorted, no repeats (needle depths)."""
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be numbers between 0 and 1, got {text!r}") from None
    if not values or any(not 0 <= v <= 1 for v in values):
        raise ValueError(f"{flag} must be numbers between 0 and 1 ({meaning}), got {text!r}")
    if len(set(values)) != len(values):
        raise ValueError(f"{flag} repeats a value: {text}")
    return sorted(values)


def finite(x: float) -> float | None:
    """JSON has no inf/nan: a perplexity that overflows is written as null."""
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None
