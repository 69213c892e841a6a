"""The JSON, Markdown tables and plot of a compare study (compare_<study>.json / .md / .png), from its summary."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from ..evaluate.report import colors, figure, markdown_table
from ..evaluate.stats import mean


def _f(x, digits=2):
    return "—" if x is None else (f"{x:.{digits}f}" if abs(x) < 1e4 else f"{x:.3g}")


def table(summary: dict) -> str:
    """Markdown tables of a study summary: per arm (means over seeds)."""

    runs = summary["runs"]
    arms = [a for a in summary["arms"] if any(r["arm"] == a for r in runs)]  # the arms done so far
    by_arm = {a: [r for r in runs if r["arm"] == a] for a in arms}
    parts = []
    lengths = summary.get("lengths") or []
    header = ["arm", "params", "final train loss", "held-out loss", "s/step"] + [f"ppl {n}" for n in lengths]
    if summary.get("seeds", [0])[1:]:
        header.insert(1, "seeds")
    rows = []
    for a in arms:
        rs = by_arm[a]
        ev = [list(r["training"].get("eval_loss", {}).values())[-1] for r in rs if r["training"].get("eval_loss")]
        row = [a, f"{rs[0].get('parameters', 0) / 1e6:.2f} M", _f(mean(r["training"].get("final_loss") for r in rs), 3),
               _f(mean(ev), 3), _f(mean(r["training"].get("seconds_per_step") for r in rs), 3)]
        row += [_f(mean(r.get("ppl", {}).get(str(n)) for r in rs)) for n in lengths]
        if summary.get("seeds", [0])[1:]:
            row.insert(1, str(len(rs)))
        rows.append(row)
    parts.append("**per arm** (held-out loss: the run's own eval split; ppl: the evaluation text, chunks of each "
                 "length; means over seeds)\n\n" + markdown_table(header, rows))
    if summary.get("step_time"):
        st = summary["step_time"]
        first = next(iter(st["seconds"].values()))
        rows = [[a, f"{t:.3f}", f"{t / first:.3f}"] for a, t in st["seconds"].items()]
        parts.append(f"**training step, side by side** (forward + backward of a [{st['batch']}] batch, median of "
                     f"{st['rounds']} rounds, arms in turn)\n\n" + markdown_table(["arm", "seconds", "ratio"], rows))
    if any("statistics" in r for r in runs):
        keys = list(next(r for r in runs if "statistics" in r)["statistics"]["nll"])
        rows = [[a] + [_f(mean(r["statistics"]["nll"][k] for r in by_arm[a] if "statistics" in r), 4) for k in keys]
                for a in arms]
        parts.append("**held-out NLL by normalisation statistics** (eval(): running; batchstats: the batch's own)\n\n"
                     + markdown_table(["arm", *keys], rows))
    if any("recall" in r for r in runs):
        ds = list(next(r for r in runs if "recall" in r)["recall"])
        rows = [[a] + [_f(mean(r["recall"][d].get("gain") for r in by_arm[a] if "recall" in r), 3) for d in ds]
                for a in arms if any("recall" in r for r in by_arm[a])]
        parts.append("**recall gain** (nats/token: NLL of a repeated span without minus with its first copy, by "
                     "distance)\n\n" + markdown_table(["arm"] + [f"d={d}" for d in ds], rows))
    if any("passkey" in r for r in runs):
        rows = []
        for r in runs:
            for n, acc in r.get("passkey", {}).items():
                rows.append([r["name"], n, _f(acc, 2)])
        parts.append("**passkey accuracy** (all depths)\n\n" + markdown_table(["run", "length", "accuracy"], rows))
    if any("grad_norms" in r for r in runs):
        rows = []
        for a in arms:
            rs = by_arm[a]
            init = [r["grad_norms"]["init"] for r in rs if r.get("grad_norms")]
            first = mean(i.get("layer.0") for i in init)
            last_key = max((k for i in init for k in i if k.startswith("layer.")), key=lambda k: int(k.split(".")[1]),
                           default=None)
            last = mean(i.get(last_key) for i in init) if last_key else None
            rows.append([a, f"{sum(r['training'].get('diverged', False) for r in rs)}/{len(rs)}",
                         _f(mean(r["training"].get("final_loss") for r in rs), 3), _f(first, 3), _f(last, 3),
                         _f(None if not first or not last else last / first, 2)])
        parts.append("**placement** (gradient norms at the first step, before clipping; diverged: loss not finite or "
                     "ending 0.5 nats above its best)\n\n" + markdown_table(
                         ["arm", "diverged", "final loss", "grad first block", "grad last block", "last / first"],
                         rows))
    return "\n\n".join(parts)


def plot(summary: dict, path: Path) -> None:
    """One figure per study, a panel per measurement present."""
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


def _json_safe(x):
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
    tmp = stem.with_suffix(f".json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(_json_safe(summary), indent=1) + "\n")
    os.replace(tmp, stem.with_suffix(".json"))
    stem.with_suffix(".md").write_text(table(summary) + "\n")
    if plot_it:
        plot(summary, stem.with_suffix(".png"))
    return stem.with_suffix(".json")
