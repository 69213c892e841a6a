"""Markdown tables and PNG plots of evaluation results (read from the results JSON, so they can be redrawn)."""

from __future__ import annotations

from ..command import markdown_table
from .common import length_label
from .stats import pooled


def _fmt(x, digits=2) -> str:
    if x is None:
        return "inf"
    if x >= 1e4:
        return f"{x:.3g}"
    return f"{x:.{digits}f}"


def _complete(cells):
    return [c for c in cells if c.get("complete")]


def ppl_tables(cells: list[dict], patches: list[str], lengths: list[int], windowings: list[str]) -> str:
    """One table per windowing and measure: rows = patch spec, columns = length."""
    done = {(c["patch"], c["windowing"], c["length"]): c for c in _complete(cells)}
    out = []
    for w in windowings:
        for measure, title, digits in (("ppl", "perplexity", 2), ("bpb", "bits per byte", 3)):
            header = ["patch"] + [length_label(n) for n in lengths]
            rows = []
            for p in patches:
                row = [p]
                for n in lengths:
                    c = done.get((p, w, n))
                    row.append("—" if c is None else _fmt(c[measure], digits))
                rows.append(row)
            stride = next((c.get("stride") for c in cells if c["windowing"] == w and c.get("stride")), None)
            label = f"{w}, stride {stride}" if w == "sliding" else w
            out.append(f"**{title}** ({label})\n\n" + markdown_table(header, rows))
    return "\n\n".join(out)


def _shown(window, lengths) -> bool:
    """Mark the trained window only where it falls inside the plotted lengths (else it squeezes the axis)."""
    return bool(window) and min(lengths) / 1.3 <= window <= max(lengths) * 1.3


def ppl_plot(cells: list[dict], patches: list[str], lengths: list[int], windowings: list[str], path,
             title: str = "", trained_window: int | None = None) -> None:
    """Perplexity vs length, one line per patch spec (solid: chunks, dashed: sliding), log-log axes."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    done = {(c["patch"], c["windowing"], c["length"]): c for c in _complete(cells)}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, p in enumerate(patches):
        for w in windowings:
            pts = [(n, done[(p, w, n)]["ppl"]) for n in lengths if (p, w, n) in done and done[(p, w, n)]["ppl"]]
            if not pts:
                continue
            label = p if len(windowings) == 1 else f"{p} ({w})"
            ax.plot(*zip(*pts), marker="o", color=colors[i % len(colors)],
                    linestyle="-" if w == "chunks" else "--", label=label)
    if _shown(trained_window, lengths):
        ax.axvline(trained_window, color="gray", linestyle=":", linewidth=1)
        ax.text(trained_window, 0.98, " trained window", transform=ax.get_xaxis_transform(), color="gray",
                fontsize=8, va="top")
    ax.set_xscale("log", base=2)
    ax.set_xlim(min(lengths) / 1.3, max(lengths) * 1.3)
    ax.set_yscale("log")
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    # perplexities of one run span a decade or two: label 1-2-5 steps, not only the powers of ten
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(lengths)
    ax.set_xticklabels([length_label(n) for n in lengths])
    ax.minorticks_off()
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("perplexity (log scale)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def accuracy_tables(cells: list[dict], patches: list[str], lengths: list[int], depths: list[float],
                    title: str = "accuracy", row: str = "depth", value: str = "accuracy") -> str:
    """One table per patch spec: rows = depth of the needle, columns = length, entries = cell[value]; plus the
    mean over depths."""
    done = {(c["patch"], c["length"], c["depth"]): c for c in _complete(cells)}
    out = []
    for p in patches:
        rows = []
        for d in depths:
            rows.append([f"{d:g}"] + [_acc(done.get((p, n, d)), value) for n in lengths])
        means = []
        for n in lengths:
            cs = [done.get((p, n, d)) for d in depths]
            means.append("—" if None in cs else f"{sum(c[value] for c in cs) / len(cs):.2f}")
        rows.append(["**mean**"] + means)
        header = [row] + [length_label(n) for n in lengths]
        out.append(f"**{p}**: {title}\n\n" + markdown_table(header, rows))
    return "\n\n".join(out)


def _acc(c, value: str) -> str:
    return "—" if c is None else f"{c[value]:.2f}"


def accuracy_heatmap(cells: list[dict], patches: list[str], lengths: list[int], depths: list[float], path,
                     title: str = "", row: str = "depth", value: str = "accuracy") -> None:
    """Depth x length heatmap of cell[value] in [0, 1], one panel per patch spec (red 0 .. green 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    done = {(c["patch"], c["length"], c["depth"]): c for c in _complete(cells)}
    size = (1.8 + 1.1 * len(lengths) * len(patches), 0.5 * len(depths) + 2.0)
    fig, axes = plt.subplots(1, len(patches), figsize=size, squeeze=False, constrained_layout=True)
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
    plt.close(fig)


def _pct(p: float, ci) -> str:
    return f"{100 * p:.0f} [{100 * ci[0]:.0f}, {100 * ci[1]:.0f}]"


def ruler_tables(cells: list[dict], patches: list[str], tasks: list[str], lengths: list[int]) -> str:
    """One table per patch spec: rows = task (+ the mean over tasks), columns = length, entries = score % [CI]."""
    done = {(c["patch"], c["task"], c["length"]): c for c in _complete(cells)}
    out = []
    for p in patches:
        rows = []
        for t in tasks:
            rows.append([t] + [_pct(c["score"], c["ci95"]) if (c := done.get((p, t, n))) else "—" for n in lengths])
        mean = []
        for n in lengths:
            cs = [done.get((p, t, n)) for t in tasks]
            mean.append("—" if None in cs else _pct(*_drop_n(pooled(cs))))
        if len(tasks) > 1:
            rows.append(["**mean**"] + mean)
        out.append(f"**{p}**\n\n" + markdown_table(["task"] + [length_label(n) for n in lengths], rows))
    return "\n\n".join(out)


def _drop_n(pooled_result):
    p, _, ci = pooled_result
    return p, ci


def ruler_plot(cells: list[dict], patches: list[str], tasks: list[str], lengths: list[int], path, title: str = "",
               trained_window: int | None = None) -> None:
    """Score vs length, one line per patch spec with its 95 % interval as error bars: one panel for the mean over
    the tasks (samples pooled) and one per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = {(c["patch"], c["task"], c["length"]): c for c in _complete(cells)}
    panels = (["mean"] if len(tasks) > 1 else []) + list(tasks)
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows + 0.6), squeeze=False, sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, panel in enumerate(panels):
        ax = axes[k // cols][k % cols]
        for i, p in enumerate(patches):
            pts = []
            for n in lengths:
                cs = [done.get((p, t, n)) for t in (tasks if panel == "mean" else [panel])]
                if None not in cs:
                    score, _, (lo, hi) = pooled(cs)
                    pts.append((n, score, lo, hi))
            if pts:
                xs, ys, los, his = zip(*pts)
                dodge = 1.06 ** (i - (len(patches) - 1) / 2)  # side by side, so that equal scores stay visible
                ys = [100 * y for y in ys]
                err = [[y - 100 * lo for y, lo in zip(ys, los)], [100 * hi - y for y, hi in zip(ys, his)]]
                ax.errorbar([x * dodge for x in xs], ys, yerr=err, marker="o", markersize=4, capsize=2,
                            color=colors[i % len(colors)], label=p)
        if _shown(trained_window, lengths):
            ax.axvline(trained_window, color="gray", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlim(min(lengths) / 1.3, max(lengths) * 1.3)
        ax.set_xticks(lengths, [length_label(n) for n in lengths])
        ax.minorticks_off()
        ax.set_ylim(-5, 105)
        ax.set_title(panel if panel != "mean" else "mean over tasks", fontsize=9)
        ax.grid(True, alpha=0.3)
        if k % cols == 0:
            ax.set_ylabel("score (%)")
    for k in range(len(panels), rows * cols):
        axes[k // cols][k % cols].axis("off")
    axes[0][0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
