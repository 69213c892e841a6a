"""The reports' PNG figures, drawn without pyplot (a library must not choose the user's matplotlib backend): the
figure, the colour cycle, length and value axes, the depth x length heatmap that passkey and needle-in-a-haystack
share.

matplotlib is imported when a plot is drawn, inside the few functions that draw, not at the top of this file: every
evaluation module imports this one, and an evaluation's `--help` (and the parsing of its arguments) must answer
without loading matplotlib, which takes about 0.4 s to import.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .parsing import length_label

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def figure(**kwargs: Any) -> Figure:
    """A matplotlib Figure that saves itself (Figure.savefig) with no pyplot state."""
    from matplotlib.figure import Figure  # drawing a plot: see the module's docstring

    return Figure(**kwargs)


def colors() -> list[str]:
    """The default colour cycle."""
    import matplotlib  # drawing a plot: see the module's docstring

    return matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]


def shows_window(window: Any, lengths: Any) -> bool:
    """Mark the trained window only where it falls inside the plotted lengths (else it squeezes the axis)."""
    return bool(window) and min(lengths) / 1.3 <= window <= max(lengths) * 1.3


def length_axis(ax: Any, lengths: list[int]) -> None:
    """A log2 x axis with a tick at each length, labelled 2k, 8k, ..."""
    ax.set_xscale("log", base=2)
    ax.set_xlim(min(lengths) / 1.3, max(lengths) * 1.3)
    ax.set_xticks(lengths, [length_label(n) for n in lengths])
    ax.minorticks_off()


# the mantissas labelled on a log value axis, by how many decades the data spans: every label stays readable, and a
# range as narrow as 5 to 6 still gets labels inside it
_LOG_SUBS = ((0.35, (1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0, 9.0)),
             (0.7, (1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0)), (1.5, (1.0, 1.5, 2.0, 3.0, 5.0, 7.0)),
             (math.inf, (1.0, 2.0, 5.0)))


def log_value_axis(ax: Any, values: list[float]) -> None:
    """A log y axis over `values` labelled with plain numbers (5, 6, 8, 10, 15, 20, ...) across the whole range,
    not only at powers of ten: matplotlib's default labels 10 and 20 and leaves 5 to 6 with none."""
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter  # drawing: see the docstring

    lo, hi = min(values), max(values)
    ax.set_yscale("log")
    ax.set_ylim(lo / 1.1, hi * 1.1)  # room for the markers, and a labelled tick on either side of narrow data
    decades = math.log10(hi * 1.1) - math.log10(lo / 1.1)
    subs = next(subs for most, subs in _LOG_SUBS if decades <= most)
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.minorticks_off()


def text_color(rgba: tuple) -> str:
    """Black or white, whichever contrasts more with a cell of colour `rgba` (WCAG relative luminance: black text
    wins above 0.179, where both contrasts are equal). Black on RdYlGn's dark green was hard to read."""
    linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgba[:3]]
    luminance = 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]
    return "black" if luminance > 0.179 else "white"


def grid_heatmap(cells: list[dict], patches: list[str], lengths: list[int], depths: list[float], path: Path | str,
                 title: str = "", row: str = "depth", value: str = "accuracy") -> None:
    """Depth x length heatmap of cell[value] in [0, 1], one panel per patch spec (red 0 .. green 1), from the
    finished cells."""
    done = {(c["patch"], c["length"], c["depth"]): c for c in cells if c.get("complete")}
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
                    ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7,
                            color=text_color(im.cmap(im.norm(grid[i, j]))))
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
