"""What the reports of results are made of: Markdown tables, numbers as the tables show them, and PNG figures drawn
without pyplot (a library must not choose the user's matplotlib backend); the depth x length grid that passkey and
needle-in-a-haystack share. Each evaluation writes its own report from these (evaluate/evaluations/); so do the
compare study and the benchmarks."""

from __future__ import annotations

import matplotlib
import numpy as np
from matplotlib.figure import Figure

from .common import length_label


def markdown_table(header: list, rows: list[list]) -> str:
    lines = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def number(x, digits: int = 2) -> str:
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


def figure(**kwargs) -> Figure:
    """A matplotlib Figure that saves itself (Figure.savefig) with no pyplot state."""
    return Figure(**kwargs)


def colors() -> list[str]:
    """The default colour cycle."""
    return matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]


def shows_window(window, lengths) -> bool:
    """Mark the trained window only where it falls inside the plotted lengths (else it squeezes the axis)."""
    return bool(window) and min(lengths) / 1.3 <= window <= max(lengths) * 1.3


def length_axis(ax, lengths: list[int]) -> None:
    """A log2 x axis with a tick at each length, labelled 2k, 8k, ..."""
    ax.set_xscale("log", base=2)
    ax.set_xlim(min(lengths) / 1.3, max(lengths) * 1.3)
    ax.set_xticks(lengths, [length_label(n) for n in lengths])
    ax.minorticks_off()


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


def _share(c, value: str) -> str:
    return "—" if c is None else f"{c[value]:.2f}"


def grid_heatmap(cells: list[dict], patches: list[str], lengths: list[int], depths: list[float], path,
                 title: str = "", row: str = "depth", value: str = "accuracy") -> None:
    """Depth x length heatmap of cell[value] in [0, 1], one panel per patch spec (red 0 .. green 1)."""
    done = {(c["patch"], c["length"], c["depth"]): c for c in complete(cells)}
    size = (1.8 + 1.1 * len(lengths) * len(patches), 0.5 * len(depths) + 2.0)
    fig = figure(figsize=size, constrained_layout=True)
    axes = fig.subplots(1, len(patches), squeeze=False)
    for k, (ax, p) in enumerate(zip(axes[0], patches)):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for i, d in enumerate(depths):
            for j, n in enumerate(lengths):
                c = done.get((p, n, d))
                if c is not None:
                    grid[i, j] = c[value]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [length_label(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("length (tokens)")
        if k == 0:
            ax.set_ylabel(row)
        ax.set_title(p, fontsize=9)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label=value)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=120, bbox_inches="tight")
