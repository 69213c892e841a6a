"""Small helpers shared by the eval/bench_*.py scripts: timing measured side by side in one run."""

from __future__ import annotations

import statistics
import time


def interleaved(fns: dict, repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Run each callable `repeats` times, alternating between them (and reversing the order every round) so that
    slow drifts of a shared 2-core machine hit all of them alike. Returns {name: [seconds, ...]}."""
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


def median(xs):
    return statistics.median(xs)


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
