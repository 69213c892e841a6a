"""What the reports of results are made of: Markdown tables, numbers as the tables show them, the depth x length
tables that passkey and needle-in-a-haystack share. Each evaluation writes its own report from these and from the
figures of plots.py (evaluate/evaluations/); so do the compare study and the benchmarks. The figure helpers are
importable from here too; like this module, importing them loads no matplotlib."""

from __future__ import annotations

from typing import Any

from .parsing import length_label
from .plots import colors as colors  # importable from here too
from .plots import figure as figure  # importable from here too
from .plots import grid_heatmap as grid_heatmap  # importable from here too
from .plots import length_axis as length_axis  # importable from here too
from .plots import log_value_axis as log_value_axis  # importable from here too
from .plots import shows_window as shows_window  # importable from here too
from .plots import text_color as text_color  # importable from here too


def markdown_table(header: list, rows: list[list]) -> str:
    lines = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def number(x: Any, digits: int = 2) -> str:
    """A measured number in a table: fixed digits, 3 significant ones from 10^4, "inf" for None (a perplexity that
    overflowed is stored as null)."""
    if x is None:
        return "inf"
    if x >= 1e4:
        return f"{x:.3g}"
    return f"{x:.{digits}f}"


def complete(cells: list[dict]) -> list[dict]:
    """The finished cells of a results file."""
    return [c for c in cells if c.get("complete")]


def grid_tables(cells: list[dict], patches: list[str], lengths: list[int], depths: list[float],
                title: str = "accuracy", row: str = "depth", value: str = "accuracy") -> str:
    """One table per patch spec: rows = depth of the needle, columns = length, entries = cell[value]; plus the
    mean over depths."""
    done = {(c["patch"], c["length"], c["depth"]): c for c in complete(cells)}
    out = []
    for p in patches:
        rows = []
        for d in depths:
            rows.append([f"{d:g}"] + [_share(done.get((p, n, d)), value) for n in lengths])
        means = []
        for n in lengths:
            cs: list = [done.get((p, n, d)) for d in depths]  # None for a missing cell: checked below
            means.append("—" if None in cs else f"{sum(c[value] for c in cs) / len(cs):.2f}")
        rows.append(["**mean**", *means])
        header = [row] + [length_label(n) for n in lengths]
        out.append(f"**{p}**: {title}\n\n" + markdown_table(header, rows))
    return "\n\n".join(out)


def _share(c: Any, value: str) -> str:
    return "—" if c is None else f"{c[value]:.2f}"
