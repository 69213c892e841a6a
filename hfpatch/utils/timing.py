"""Timing what is compared side by side: the benchmarks (eval/bench_*.py) and the compare study's training steps.
Runs of the things compared alternate, so that the drifts of a shared machine hit all of them alike. And a duration
in words, as the reports and estimates print it."""

from __future__ import annotations

import statistics
import time


def interleaved(fns: dict, repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Run each callable `repeats` times, alternating between them (and reversing the order every round) after
    `warmup` untimed rounds. Returns {name: [seconds, ...]}."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def medians(fns: dict, repeats: int, warmup: int = 1) -> dict[str, float]:
    """{name: the median of its `interleaved` times}."""
    return {name: statistics.median(ts) for name, ts in interleaved(fns, repeats, warmup).items()}


def duration(seconds: float) -> str:
    """Seconds in words a report shows: "45 s", "12 min", "2.5 h"."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
