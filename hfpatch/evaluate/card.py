"""`hfpatch card DIR --results RUN_DIR...`: the evaluation tables and plots of `hfpatch eval` runs in the model card
of a folder hfpatch saved.

A run's folder holds results.json (which says the evaluation's kind), the table.md the command printed and, unless
it ran with --no-plot, its plot (ppl.png, passkey.png, ...). The card (README.md, written by
hfpatch.save_pretrained) gets a section between RESULTS_START and RESULTS_END with each run's table, and each plot
is copied into DIR/PLOTS and linked from it. A second `card` run replaces that section and those plots; the rest of
the card (the user's own text, hfpatch's patch section) is kept. Everything is checked before anything is written,
and the card is replaced whole.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..interop.io import CARD_END, CARD_START, with_section
from . import EVALUATIONS, evaluation

RESULTS_START, RESULTS_END = "<!-- hfpatch:results:start -->", "<!-- hfpatch:results:end -->"
PLOTS = "hfpatch-evaluations"  # the folder in DIR the plots are copied to, replaced whole by each `card` run
HEADING = "## Evaluations"


@dataclass(frozen=True)
class Run:
    """One `hfpatch eval` run's folder, read: what the card shows of it."""

    name: str  # the folder's name (its path is the user's machine's, not the card's)
    kind: str  # the evaluation: ppl, passkey, ruler, niah
    table: str  # table.md as the command wrote it
    plot: Path | None  # the evaluation's plot, where the run drew one


def read_run(path: Path | str) -> Run:
    """A run folder, or ValueError saying what is missing."""
    folder = Path(path)
    results = folder / "results.json"
    if not results.is_file():
        raise ValueError(f"--results {path}: no results.json there; give the --out folder of an hfpatch eval run")
    try:
        kind = json.loads(results.read_text(encoding="utf-8"))["kind"]
    except (ValueError, KeyError, TypeError):
        kind = None
    runs = {evaluation(name).kind: evaluation(name) for name in EVALUATIONS}  # results files say their kind
    if kind not in runs:
        raise ValueError(f"--results {path}: its results.json is not one hfpatch eval writes (the evaluations: "
                         f"{', '.join(EVALUATIONS)})")
    ev = runs[kind]
    table = folder / "table.md"
    if not table.is_file():
        raise ValueError(f"--results {path}: no table.md there (the run has not finished: run the same hfpatch eval "
                         "command again to complete it)")
    plot = folder / ev.plot_name
    return Run(folder.resolve().name, ev.name, table.read_text(encoding="utf-8").strip(),
               plot if plot.is_file() else None)


def check_card(folder: Path | str) -> Path:
    """The README.md of a folder hfpatch saved (it carries hfpatch's section), or ValueError."""
    path = Path(folder)
    if not path.is_dir():
        raise ValueError(f"{folder} is not a folder: give the folder hfpatch.save_pretrained or hfpatch patch --out "
                         "wrote")
    readme = path / "README.md"
    if not readme.is_file():
        raise ValueError(f"{folder} has no model card (README.md): give a folder hfpatch.save_pretrained or hfpatch "
                         "patch --out wrote")
    text = readme.read_text(encoding="utf-8")
    if CARD_START not in text or CARD_END not in text:
        raise ValueError(f"{folder}/README.md has no hfpatch section: the folder was not saved by hfpatch "
                         "(hfpatch.save_pretrained or hfpatch patch --out write one)")
    return readme


def plot_names(runs: list[Run]) -> list[str | None]:
    """Where each run's plot goes in DIR (relative, as the card links it): PLOTS/NAME-KIND.png, numbered where two
    runs share a name."""
    names: list[str | None] = []
    for i, run in enumerate(runs):
        if run.plot is None:
            names.append(None)
            continue
        name = f"{PLOTS}/{run.name}-{run.kind}.png"
        names.append(f"{PLOTS}/{i + 1}-{run.name}-{run.kind}.png" if name in names else name)
    return names


def section(runs: list[Run], plots: list[str | None]) -> str:
    """The card's evaluations section: each run's table and its plot."""
    parts = [HEADING, "Measured with `hfpatch eval` (each run's `table.md`, as the command printed it)."]
    for run, plot in zip(runs, plots, strict=True):
        parts.append(f"### {run.kind}: {run.name}\n\n{run.table}")
        if plot is not None:
            parts.append(f"![{run.kind}: {run.name}]({plot})")
    return "\n\n".join(parts) + "\n"


def with_results(card: str, runs: list[Run], plots: list[str | None]) -> str:
    """The card with its evaluations section replaced (or added at the end)."""
    return with_section(card, section(runs, plots), RESULTS_START, RESULTS_END)


def add_results(folder: Path | str, run_folders: list[str]) -> Path:
    """The runs' tables and plots in the folder's card; returns the card's path. Everything is read and checked
    first; the plots are copied to a new folder that replaces DIR/PLOTS, then the card is replaced whole."""
    readme = check_card(folder)
    runs = [read_run(r) for r in run_folders]
    plots = plot_names(runs)
    card = with_results(readme.read_text(encoding="utf-8"), runs, plots)
    target = Path(folder) / PLOTS
    staged, old = target.with_name(PLOTS + ".partial"), target.with_name(PLOTS + ".old")
    for leftover in (staged, old):  # an interrupted run's
        shutil.rmtree(leftover, ignore_errors=True)
    staged.mkdir()
    try:
        for run, plot in zip(runs, plots, strict=True):
            if run.plot is not None and plot is not None:
                shutil.copyfile(run.plot, Path(folder) / plot.replace(PLOTS, staged.name, 1))
        Path(str(readme) + ".partial").write_text(card, encoding="utf-8")
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        Path(str(readme) + ".partial").unlink(missing_ok=True)
        raise
    if target.exists():
        os.replace(target, old)
    if any(staged.iterdir()):
        os.replace(staged, target)
    else:  # no run drew a plot: no folder of them
        staged.rmdir()
    os.replace(str(readme) + ".partial", readme)
    shutil.rmtree(old, ignore_errors=True)
    return readme
