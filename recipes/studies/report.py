"""The JSON, Markdown tables and plot of a compare study (compare_<study>.json / .md / .png), from its summary."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from hfpatch.evaluate.report import colors, figure, markdown_table
from hfpatch.evaluate.stats import mean
from hfpatch.utils.files import write_file

from .study import grid_arms


def _f(x: Any, digits: int = 2):
    return "—" if x is None else (f"{x:.{digits}f}" if abs(x) < 1e4 else f"{x:.3g}")


def table(summary: dict) -> str:
    """Markdown tables of a study summary: per arm (means over seeds)."""
    runs = summary["runs"]
    grid = grid_of(summary)  # a grid's arms have tables of their own (below); these are the other arms
    arms = [a for a in summary["arms"] if a not in grid and any(r["arm"] == a for r in runs)]  # the arms done so far
    by_arm = {a: [r for r in runs if r["arm"] == a] for a in arms}
    parts = [part for part in (_per_arm_table(summary, by_arm, bool(grid)), _step_time_table(summary),
                               _statistics_table(runs, by_arm), _recall_table(runs, by_arm), _passkey_table(runs),
                               _placement_table(by_arm)) if part]
    if grid:
        parts = [sweep_table(summary), *([init_grad_table(summary)] if any("grad_norms" in r for r in runs) else []),
                 *parts]
    return "\n\n".join(parts)


def _per_arm_table(summary: dict, by_arm: dict[str, list], grid: bool) -> str | None:
    """Loss, size, speed and perplexities of each arm, means over its seeds (None: no arm done)."""
    lengths = summary.get("lengths") or []
    seeds = bool(summary.get("seeds", [0])[1:])
    header = ["arm", "params", "final train loss", "held-out loss", "s/step"] + [f"ppl {n}" for n in lengths]
    if seeds:
        header.insert(1, "seeds")
    rows = []
    for a, rs in by_arm.items():
        ev = [list(r["training"].get("eval_loss", {}).values())[-1] for r in rs if r["training"].get("eval_loss")]
        row = [a, f"{rs[0].get('parameters', 0) / 1e6:.2f} M", _f(mean(r["training"].get("final_loss") for r in rs), 3),
               _f(mean(ev), 3), _f(mean(r["training"].get("seconds_per_step") for r in rs), 3)]
        row += [_f(mean(r.get("ppl", {}).get(str(n)) for r in rs)) for n in lengths]
        if seeds:
            row.insert(1, str(len(rs)))
        rows.append(row)
    if not rows:
        return None
    return (f"**per arm{' (outside the grid)' if grid else ''}** (held-out loss: the run's own eval split; "
            "ppl: the evaluation text, chunks of each length; means over seeds)\n\n" + markdown_table(header, rows))


def _step_time_table(summary: dict) -> str | None:
    """The training step of each arm timed side by side (None: not measured)."""
    if not summary.get("step_time"):
        return None
    st = summary["step_time"]
    first = next(iter(st["seconds"].values()))
    rows = [[a, f"{t:.3f}", f"{t / first:.3f}"] for a, t in st["seconds"].items()]
    return (f"**training step, side by side** (forward + backward of a [{st['batch']}] batch, median of "
            f"{st['rounds']} rounds, arms in turn)\n\n" + markdown_table(["arm", "seconds", "ratio"], rows))


def _statistics_table(runs: list, by_arm: dict[str, list]) -> str | None:
    """Held-out NLL with each kind of normalisation statistics (None: not measured)."""
    if not any("statistics" in r for r in runs):
        return None
    keys = list(next(r for r in runs if "statistics" in r)["statistics"]["nll"])
    rows = [[a] + [_f(mean(r["statistics"]["nll"][k] for r in rs if "statistics" in r), 4) for k in keys]
            for a, rs in by_arm.items()]
    return ("**held-out NLL by normalisation statistics** (eval(): running; batchstats: the batch's own)\n\n"
            + markdown_table(["arm", *keys], rows))


def _recall_table(runs: list, by_arm: dict[str, list]) -> str | None:
    """The recall gain of each arm by distance (None: not measured)."""
    if not any("recall" in r for r in runs):
        return None
    ds = list(next(r for r in runs if "recall" in r)["recall"])
    rows = [[a] + [_f(mean(r["recall"][d].get("gain") for r in rs if "recall" in r), 3) for d in ds]
            for a, rs in by_arm.items() if any("recall" in r for r in rs)]
    return ("**recall gain** (nats/token: NLL of a repeated span without minus with its first copy, by "
            "distance)\n\n" + markdown_table(["arm"] + [f"d={d}" for d in ds], rows))


def _passkey_table(runs: list) -> str | None:
    """Passkey accuracy of each run by length (None: not measured)."""
    if not any("passkey" in r for r in runs):
        return None
    rows = [[r["name"], n, _f(acc, 2)] for r in runs for n, acc in r.get("passkey", {}).items()]
    return "**passkey accuracy** (all depths)\n\n" + markdown_table(["run", "length", "accuracy"], rows)


def _placement_table(by_arm: dict[str, list]) -> str | None:
    """Divergence, final loss and the gradient norms of the first and last block at the first step, per arm (None:
    no gradient norms recorded)."""
    if not any("grad_norms" in r for rs in by_arm.values() for r in rs):
        return None
    rows = []
    for a, rs in by_arm.items():
        init = [r["grad_norms"]["init"] for r in rs if r.get("grad_norms")]
        first = mean(i.get("layer.0") for i in init)
        last_key = max((k for i in init for k in i if k.startswith("layer.")), key=lambda k: int(k.split(".")[1]),
                       default=None)
        last = mean(i.get(last_key) for i in init) if last_key else None
        rows.append([a, f"{sum(r['training'].get('diverged', False) for r in rs)}/{len(rs)}",
                     _f(mean(r["training"].get("final_loss") for r in rs), 3), _f(first, 3), _f(last, 3),
                     _f(None if not first or not last else last / first, 2)])
    return ("**placement** (gradient norms at the first step, before clipping; diverged: loss not finite "
            "or ending 0.5 nats above its best)\n\n" + markdown_table(
                ["arm", "diverged", "final loss", "grad first block", "grad last block", "last / first"], rows))


# ------------------------------------------------------------------------------------------------ grid studies

def grid_of(summary: dict) -> dict:
    """{arm: {axis: label}} of a study whose arms come from a grid (study.grid_arms); {} otherwise."""
    return {arm: labels for arm, (labels, _) in grid_arms(summary.get("config", {}).get("grid") or {}).items()}


def _runs_by_arm(summary: dict) -> dict:
    out: dict = {}
    for r in summary["runs"]:
        out.setdefault(r["arm"], []).append(r)
    return out


def sweep_table(summary: dict) -> str:
    """Final training loss (10-step mean, mean over seeds) with the grid's last axis as columns and every
    combination of the other axes as a row; † marks a diverged run (loss not finite, or ending 0.5 nats above its
    best 10-step mean)."""
    grid, by_arm = grid_of(summary), _runs_by_arm(summary)
    axes = list(summary["config"]["grid"])
    *row_axes, col_axis = axes
    columns = list(dict.fromkeys(labels[col_axis] for labels in grid.values()))
    rows: dict[tuple, list] = {}
    for arm, labels in grid.items():
        key = tuple(labels[a] for a in row_axes)
        cells = rows.setdefault(key, [""] * len(columns))
        rs = by_arm.get(arm, [])
        if not rs:
            cells[columns.index(labels[col_axis])] = "…"  # not run yet
            continue
        final = mean(r["training"].get("final_loss") for r in rs)
        diverged = sum(bool(r["training"].get("diverged")) for r in rs)
        mark = "" if not diverged else " †" if len(rs) == 1 else f" †{diverged}/{len(rs)}"
        cells[columns.index(labels[col_axis])] = ("nan" if final is None else f"{final:.3f}") + mark
    head = f"**final training loss by {col_axis}** (mean of the last 10 steps; † diverged"
    head += f"; unigram loss of the training text: {summary['unigram_loss']:.3f})" if summary.get("unigram_loss") \
        else ")"
    return head + "\n\n" + markdown_table([*row_axes, *(f"{col_axis} {c}" for c in columns)],
                                           [[*key, *cells] for key, cells in rows.items()])


def step1_axes(summary: dict) -> list[str]:
    """The grid axes that change the gradients at the first step: an axis does not when every two runs that differ
    in it alone (same seed) have the same first-step gradient norms (the learning rate and the warm-up, whose first
    step comes after the gradient is taken)."""
    grid = grid_of(summary)
    runs = [r for r in summary["runs"] if r["arm"] in grid and r.get("grad_norms", {}).get("init")]
    keep = []
    for axis in summary["config"]["grid"]:
        def rest(r: Any, axis: Any = axis):
            return (r["seed"], *(v for a, v in grid[r["arm"]].items() if a != axis))
        groups: dict = {}
        for r in runs:
            groups.setdefault(rest(r), []).append(r["grad_norms"]["init"])
        paired = any(len(g) > 1 for g in groups.values())  # without a pair, nothing shows that it does not
        same = paired and all(math.isclose(g[0].get(k, 0.0), x.get(k, 0.0), rel_tol=1e-4, abs_tol=1e-12)
                   for g in groups.values() for x in g[1:] for k in set(g[0]) | set(x))
        if not same:
            keep.append(axis)
    return keep


def _blocks(init: dict) -> list[float]:
    layers = sorted((k for k in init if k.startswith("layer.")), key=lambda k: int(k.split(".")[1]))
    return [init[k] for k in layers]


def init_grad_groups(summary: dict) -> dict[tuple, list[dict]]:
    """{labels of the axes that change the first step: [first-step gradient norms of its runs]}."""
    grid, axes = grid_of(summary), step1_axes(summary)
    out: dict = {}
    seen = set()
    for r in (r for r in summary["runs"] if r["arm"] in grid):
        init = r.get("grad_norms", {}).get("init")
        key = tuple(grid[r["arm"]][a] for a in axes)
        if init and (key, r["seed"]) not in seen:  # one run per seed: the others have the same first step
            seen.add((key, r["seed"]))
            out.setdefault(key, []).append(init)
    return out


FFN_OUT = "mlp.down_proj.weight"  # Llama's feed-forward output weight: W^FC2, the weight of Xiong et al.'s analysis


def _ffn_out(r: dict) -> list[float] | None:
    """The feed-forward output weight's first-step gradient norm per block, where the run recorded it."""
    per = r.get("grad_norms", {}).get("init_parameters")
    if not per or any(FFN_OUT not in v for v in per.values()):
        return None
    return [v[FFN_OUT] for v in per.values()]


def init_ffn_groups(summary: dict) -> dict[tuple, list[list[float]]]:
    """As init_grad_groups, the feed-forward output weight's norms per block."""
    grid, axes = grid_of(summary), step1_axes(summary)
    out: dict = {}
    seen = set()
    for r in (r for r in summary["runs"] if r["arm"] in grid):
        ffn = _ffn_out(r)
        key = tuple(grid[r["arm"]][a] for a in axes)
        if ffn and (key, r["seed"]) not in seen:
            seen.add((key, r["seed"]))
            out.setdefault(key, []).append(ffn)
    return out


def init_grad_table(summary: dict) -> str:
    """Gradient norm per block at the first step, before any update (means over seeds); and of the feed-forward
    output weight alone, where recorded."""
    axes = step1_axes(summary)
    rows = []
    for key, inits in init_grad_groups(summary).items():
        blocks = [_blocks(i) for i in inits]
        n = len(blocks[0])
        first, mid, last = (mean(b[j] for b in blocks) for j in (0, n // 2, n - 1))
        rows.append([*key, _f(mean(i.get("embedding") for i in inits), 3), _f(first, 3), _f(mid, 3), _f(last, 3),
                     _f(None if not first or not last else last / first, 2),
                     _f(mean(i.get("final") for i in inits), 3)])
    other = [a for a in summary["config"]["grid"] if a not in axes]
    return (f"**gradient norms at initialisation** (the first step, before clipping; the same for every "
            f"{' and '.join(other) or 'arm'}; blocks: the first, the middle (n/2, from 0) and the last; final: the "
            "final norm; embedding: the tied table, input and output)\n\n"
            + markdown_table([*axes, "embedding", "first block", "middle block", "last block", "last / first",
                              "final"], rows) + _ffn_table(summary, axes))


def _ffn_table(summary: dict, axes: list[str]) -> str:
    groups = init_ffn_groups(summary)
    if not groups:
        return ""
    rows = []
    for key, per in groups.items():
        n = len(per[0])
        first, mid, last = (mean(p[j] for p in per) for j in (0, n // 2, n - 1))
        rows.append([*key, _f(first, 4), _f(mid, 4), _f(last, 4), _f(None if not first or not last else last / first,
                                                                          2)])
    return (f"\n\n**gradient norm of the feed-forward output weight at initialisation** (`{FFN_OUT}`, W^FC2 in "
            "Xiong et al. 2020; the first step, before clipping)\n\n"
            + markdown_table([*axes, "first block", "middle block", "last block", "last / first"], rows))


def plot(summary: dict, path: Path) -> None:
    """One figure per study, a panel per measurement present."""
    if grid_of(summary):
        return plot_grid(summary, path)
    runs, arms = summary["runs"], list(summary["arms"])
    panels = ["loss"]
    if summary.get("lengths"):
        panels.append("ppl")
    if any("recall" in r for r in runs):
        panels.append("recall")
    if any("grad_norms" in r for r in runs):
        panels += ["grad_init", "grad_train"]
    fig = figure(figsize=(5.2 * len(panels), 4.2))
    axes = fig.subplots(1, len(panels), squeeze=False)
    arm_colors = {a: c for a, c in zip(arms, colors() * 4)}
    for ax, panel in zip(axes[0], panels):
        for a in arms:
            for k, r in enumerate(x for x in runs if x["arm"] == a):
                label = a if k == 0 else None
                if panel == "loss" and r["training"].get("loss"):
                    y = r["training"]["loss"]
                    ax.plot(range(1, len(y) + 1), y, color=arm_colors[a], lw=0.8, alpha=0.8, label=label)
                elif panel == "ppl":
                    pts = [(int(n), v) for n, v in r.get("ppl", {}).items() if v]
                    if pts:
                        ax.plot(*zip(*sorted(pts)), marker="o", color=arm_colors[a], label=label)
                elif panel == "recall" and "recall" in r:
                    pts = [(int(d), v["gain"]) for d, v in r["recall"].items() if "gain" in v]
                    if pts:
                        ax.plot(*zip(*sorted(pts)), marker="o", color=arm_colors[a], label=label)
                elif panel == "grad_init" and r.get("grad_norms"):
                    init = r["grad_norms"]["init"]
                    layers = sorted((k for k in init if k.startswith("layer.")), key=lambda k: int(k.split(".")[1]))
                    ax.plot(range(len(layers)), [init[k] for k in layers], marker=".", color=arm_colors[a], label=label)
                elif panel == "grad_train" and r.get("grad_norms"):
                    rows = r["grad_norms"]["steps"]
                    ax.plot([x["step"] for x in rows], [x["total"] for x in rows], color=arm_colors[a], lw=0.8,
                            label=label)
        titles = {"loss": ("training loss", "step", "loss"), "ppl": ("held-out perplexity", "length", "perplexity"),
                  "recall": ("recall gain of a repeated span", "distance (tokens)", "nats / token"),
                  "grad_init": ("gradient norm per block, step 1", "block", "norm (before clipping)"),
                  "grad_train": ("total gradient norm", "step", "norm (before clipping)")}
        title, xl, yl = titles[panel]
        ax.set_title(title)
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        if panel in ("ppl", "grad_init", "grad_train"):
            ax.set_yscale("log")
        if panel in ("ppl", "recall"):
            ax.set_xscale("log", base=2)
            if summary.get("trained_length"):
                ax.axvline(summary["trained_length"], color="gray", ls=":", lw=1)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"compare: {summary['study']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_grid(summary: dict, path: Path) -> None:
    """A grid study (axes A, B, ..., last axis X): row 1, the gradient norm per block at the first step, a panel
    per label of A, a line per combination of the other axes that change it; row 2, the final loss against X, a
    panel per (A, B), a line per combination of the rest, × where a run diverged; row 3, the loss curves at X's
    largest value, panels as row 2."""
    grid = grid_of(summary)
    axes = list(summary["config"]["grid"])
    panel_axes = axes[:min(2, len(axes) - 1)]
    panels = list(dict.fromkeys(tuple(labels[a] for a in panel_axes) for labels in grid.values()))
    palette = colors() * 4
    fig = figure(figsize=(4.6 * len(panels), 12.5))
    axs = fig.subplots(3, len(panels), squeeze=False)
    used = _plot_init_gradients(axs[0], summary, palette)
    used += _plot_arms_outside_grid(axs[0], used, len(panels), summary, palette)
    for ax in axs[0][used:]:
        ax.set_visible(False)
    _plot_grid_losses(axs, summary, panels, palette)
    fig.suptitle(f"compare: {summary['study']} (dotted: unigram loss of the training text; ×: diverged)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _plot_init_gradients(row: list, summary: dict, palette: list) -> int:
    """Row 1 of plot_grid: the gradient norm per block at initialisation, a panel per label of the first axis where
    the first step changes with it (else one panel). Returns the number of panels drawn."""
    axes = list(summary["config"]["grid"])
    groups, ffn_groups = init_grad_groups(summary), init_ffn_groups(summary)
    s1 = step1_axes(summary)
    firsts = list(dict.fromkeys(k[0] for k in groups)) if s1 and s1[0] == axes[0] else [None]
    kinds = list(dict.fromkeys(k[1:] if firsts != [None] else k for k in groups))
    for ax, first in zip(row, firsts):
        for key, inits in groups.items():
            if first is not None and key[0] != first:
                continue
            rest = key[1:] if first is not None else key
            blocks = [_blocks(i) for i in inits]
            ys = [mean(b[j] for b in blocks) for j in range(len(blocks[0]))]
            ax.plot(range(len(ys)), ys, marker=".", color=palette[kinds.index(rest)], label=" ".join(rest) or "_")
            ffn = ffn_groups.get(key)
            if ffn:  # the feed-forward output weight alone (W^FC2)
                ax.plot(range(len(ffn[0])), [mean(p[j] for p in ffn) for j in range(len(ffn[0]))], ls="--",
                        lw=0.9, color=palette[kinds.index(rest)])
        ax.set_title(f"gradient norm per block at init{f', {axes[0]} {first}' if first else ''}"
                     f"{' (dashed: FFN output weight)' if ffn_groups else ''}", fontsize=9)
        ax.set_xlabel("block (0 = next to the embedding)")
        ax.set_ylabel("norm (before clipping)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if any(not lab.startswith("_") for lab in ax.get_legend_handles_labels()[1]):
            ax.legend(fontsize=7)
    return len(firsts)


def _plot_arms_outside_grid(row: list, used: int, panels: int, summary: dict, palette: list) -> int:
    """The loss curves of the arms outside the grid, in row 1's next free panel if there is one. Returns the number
    of panels drawn (0 or 1)."""
    grid = grid_of(summary)
    others = [r for r in summary["runs"] if r["arm"] not in grid]
    if not others or used >= panels:  # nothing to draw, or no free panel left for it
        return 0
    ax = row[used]
    for k, r in enumerate(others):
        ax.plot(range(1, len(r["training"]["loss"]) + 1), r["training"]["loss"], color=palette[k], lw=0.8,
                label=r["name"])
    if summary.get("unigram_loss"):
        ax.axhline(summary["unigram_loss"], color="gray", ls=":", lw=1)
    ax.set_title("training loss, arms outside the grid", fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return 1


def _plot_grid_losses(axs: Any, summary: dict, panels: list, palette: list) -> None:
    """Rows 2 and 3 of plot_grid: the final loss against the last axis, and the loss curves at its largest value."""
    grid, by_arm = grid_of(summary), _runs_by_arm(summary)
    axes = list(summary["config"]["grid"])
    panel_axes, x_axis = axes[:min(2, len(axes) - 1)], axes[-1]
    line_axes = [a for a in axes if a not in panel_axes and a != x_axis]
    xs = list(dict.fromkeys(labels[x_axis] for labels in grid.values()))
    lines = list(dict.fromkeys(tuple(labels[a] for a in line_axes) for labels in grid.values()))
    top = max(xs, key=float) if all(_is_number(x) for x in xs) else xs[-1]
    for col, panel in enumerate(panels):
        for k, line in enumerate(lines):
            pts, bad = [], []
            for x in xs:
                labels = dict(zip(panel_axes, panel)) | dict(zip(line_axes, line)) | {x_axis: x}
                arm = next((a for a, lab in grid.items() if lab == labels), None)
                for r in by_arm.get(arm, []):
                    final = r["training"].get("final_loss")
                    xv = float(x) if _is_number(x) else xs.index(x)
                    if final is not None:
                        pts.append((xv, final))
                    if r["training"].get("diverged"):
                        bad.append((xv, final if final is not None else r["training"].get("best_loss") or 0))
                    if x == top:
                        axs[2][col].plot(range(1, len(r["training"]["loss"]) + 1), r["training"]["loss"],
                                         color=palette[k], lw=0.8, label=" ".join(line) or "_")
            if pts:
                axs[1][col].plot(*zip(*sorted(pts)), marker="o", color=palette[k], label=" ".join(line) or "_")
            if bad:
                axs[1][col].scatter(*zip(*bad), marker="x", s=80, color="black", zorder=3)
        name = ", ".join(f"{a} {v}" for a, v in zip(panel_axes, panel))
        _label_loss_panels(axs, col, summary, name, top)
        if all(_is_number(x) for x in xs):
            axs[1][col].set_xscale("log")


def _label_loss_panels(axs: Any, col: int, summary: dict, name: str, top: str) -> None:
    """Titles, labels, the unigram line and the legend of column `col`'s loss panels (rows 2 and 3)."""
    x_axis = list(summary["config"]["grid"])[-1]
    for row, (title, xl) in ((1, (f"final loss, {name}", x_axis)), (2, (f"loss at {x_axis} {top}, {name}", "step"))):
        ax = axs[row][col]
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xl)
        ax.set_ylabel("training loss")
        ax.grid(alpha=0.3)
        if summary.get("unigram_loss"):
            ax.axhline(summary["unigram_loss"], color="gray", ls=":", lw=1)
        if any(not lab.startswith("_") for lab in ax.get_legend_handles_labels()[1]):
            ax.legend(fontsize=7)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _json_safe(x: Any):
    """JSON has no NaN or infinity: they are written as null. Floats keep 6 significant digits (the runs' loss and
    gradient curves would otherwise fill megabytes with noise digits)."""
    if isinstance(x, float):
        return float(f"{x:.6g}") if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def write(summary: dict, out: Path, plot_it: bool = True) -> Path:
    """compare_<study>.json (atomically), .md and .png under `out`; returns the JSON's path."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"compare_{summary['study']}"
    text = json.dumps(_json_safe(summary), indent=1) + "\n"
    write_file(stem.with_suffix(".json"), lambda tmp: tmp.write_text(text))
    stem.with_suffix(".md").write_text(table(summary) + "\n")
    if plot_it:
        plot(summary, stem.with_suffix(".png"))
    return stem.with_suffix(".json")
