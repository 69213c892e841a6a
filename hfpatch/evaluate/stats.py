"""The statistics the reports use: the Wilson interval of a score over samples, scores pooled over cells, and the
mean of what was measured (runs that produced no number left out)."""

from __future__ import annotations

import math
import statistics
from typing import Any

Z95 = statistics.NormalDist().inv_cdf(0.975)


def wilson(p: float, n: int, z: float = Z95) -> tuple[float, float]:
    """95 % Wilson score interval of a binomial proportion p observed over n trials."""
    if n == 0:
        return 0.0, 1.0
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def pooled(cells: list[dict], records: str = "samples", value: str = "score") -> tuple[float, int,
                                                                                         tuple[float, float]]:
    """The mean of `value` over several cells' records together, their number, and its Wilson interval."""
    scores = [r[value] for c in cells for r in c[records]]
    p = sum(scores) / len(scores)
    return p, len(scores), wilson(p, len(scores))


def mean(xs: Any) -> float | None:
    """The mean of the finite numbers among xs (None and NaN are runs that produced none); None if there are none."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.fmean(xs) if xs else None
