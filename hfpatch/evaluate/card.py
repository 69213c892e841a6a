"""`hfpatch card DIR --results RUN_DIR...`: the evaluation tables and plots of `hfpatch eval` runs in the model card
of a folder hfpatch saved.

A run's folder holds results.json (which says the evaluation's kind and records the evaluated model's files by
content), the table.md the command printed and, unless it ran with --no-plot, its plot (ppl.png, passkey.png, ...).
Only the runs of the model files in DIR are taken: the others are left out, with a warning naming them and why.
The card (README.md, written by hfpatch.save_pretrained) gets a section between RESULTS_START and RESULTS_END with
each run's table, drawn again from its results.json as the command drew it but naming the model as the card may
(public_name: a local path becomes its last name), the model files it is of (a later save that changes them
removes the section), and each run's plot, drawn again the same way into DIR/PLOTS and linked from it. A second
`card` run replaces that section and those plots; the rest of the card (the user's own text, hfpatch's patch
section) is kept. Everything is checked before anything is written, and the card is replaced whole; a folder that
cannot be written is one error.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..interop.io import (
    CARD_END,
    CARD_START,
    PLOTS,  # the folder in DIR the plots are drawn in, replaced whole by each `card` run
    RESULTS_END,
    RESULTS_START,
    public_name,
    results_model_line,
    with_section,
)
from ..models import model_fingerprint
from ..utils.files import describe_os_error, differences, write_file
from . import EVALUATIONS, evaluation
from .sweep import covering, loaded_note

HEADING = "## Evaluations"
LOADED = {"config", "weights", "tokenizer"}  # model_files of a model the caller loaded (sweep.loaded_fingerprint)


@dataclass(frozen=True)
class Run:
    """One `hfpatch eval` run's folder, read: what the card shows of it."""

    name: str  # the folder's name (its path is the user's machine's, not the card's)
    kind: str  # the evaluation: ppl, passkey, ruler, niah
    table: str  # table.md as the command wrote it, the model named by public_name
    plot: Path | None  # the evaluation's plot, where the run drew one
    model: str = ""  # the evaluated model, as public_name names it
    model_files: Any = None  # what the results file records of the evaluated model (identity's model_files)
    caption: str = ""  # the table's caption, the plot's title
    data: dict = field(default_factory=dict, repr=False)  # the results, as the report draws them

    def draw(self, path: Path) -> None:
        """The run's plot, drawn again (as the command drew it, the model named by public_name) at `path`."""
        evaluation(self.kind).plot(self.data, path, self.caption)


def read_run(path: Path | str) -> Run:
    """A run folder, or ValueError saying what is missing."""
    folder = Path(path)
    results = folder / "results.json"
    if not results.is_file():
        raise ValueError(f"--results {path}: no results.json there; give the --out folder of an hfpatch eval run")
    try:
        data = json.loads(results.read_text(encoding="utf-8"))
        kind = data["kind"]
    except (ValueError, KeyError, TypeError):
        data, kind = {}, None
    runs = {evaluation(name).kind: evaluation(name) for name in EVALUATIONS}  # results files say their kind
    if not isinstance(kind, str) or kind not in runs:
        raise ValueError(f"--results {path}: its results.json is not one hfpatch eval writes (the evaluations: "
                         f"{', '.join(EVALUATIONS)})")
    ev = runs[kind]
    table = folder / "table.md"
    if not table.is_file():
        raise ValueError(f"--results {path}: no table.md there (the run has not finished: run the same hfpatch eval "
                         "command again to complete it)")
    plot = folder / ev.plot_name
    identity = data.get("identity") if isinstance(data.get("identity"), dict) else {}
    given = str(identity.get("model", ""))
    try:  # a results file edited or damaged by hand: its fields of other types than a run writes
        shown = _named(ev, data, given, public_name(given))
        caption = ev.caption(shown) + loaded_note(shown)
        text = f"{caption}\n\n{ev.tables(shown)}"
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise ValueError(f"--results {path}: its results.json cannot be read back ({type(e).__name__}: {e}); give "
                         "the --out folder of a finished hfpatch eval run") from None
    return Run(folder.resolve().name, ev.name, text.strip(), plot if plot.is_file() else None,
               public_name(given), identity.get("model_files"), caption, shown)


def _named(ev: Any, data: dict, given: str, shown: str) -> dict:
    """The results as the report reads them (covering), with the model named `shown` wherever its name was `given`
    (an engine's name keeps its suffix: "NAME (vLLM)")."""
    model = dict(data.get("model") or {})
    name = str(model.get("name", given))
    model["name"] = name.replace(given, shown) if given else name
    return covering(ev, {**data, "model": model, "identity": {**data.get("identity", {}), "model": shown}})


def check_card(folder: Path | str) -> Path:
    """The README.md of a folder hfpatch saved (it carries hfpatch's section), or ValueError."""
    path = Path(folder)
    if not str(folder).strip() or not path.is_dir():  # ("" is no folder: Path("") would be the current one)
        raise ValueError(f"{folder or repr(folder)} is not a folder: give the folder hfpatch.save_pretrained or "
                         "hfpatch patch --out wrote")
    readme = path / "README.md"
    if not readme.is_file():
        raise ValueError(f"{folder} has no model card (README.md): give a folder hfpatch.save_pretrained or hfpatch "
                         "patch --out wrote")
    try:
        text = readme.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{readme}: not UTF-8 text ({e.reason} at byte {e.start}), so not a card hfpatch "
                         "wrote") from None
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


def section(runs: list[Run], plots: list[str | None], model: dict | None = None) -> str:
    """The card's evaluations section: each run's table and its plot; with `model` (the folder's model files), the
    line that says which files they are of."""
    parts = [results_model_line(model)] if model else []
    parts += [HEADING, "Measured with `hfpatch eval` (each run's table as the command printed it, the model named "
              "by its folder's name)."]
    for run, plot in zip(runs, plots, strict=True):
        parts.append(f"### {run.kind}: {run.name}\n\n{run.table}")
        if plot is not None:
            parts.append(f"![{run.kind}: {run.name}]({plot})")
    return "\n\n".join(parts) + "\n"


def with_results(card: str, runs: list[Run], plots: list[str | None], model: dict | None = None) -> str:
    """The card with its evaluations section replaced (or added at the end)."""
    return with_section(card, section(runs, plots, model), RESULTS_START, RESULTS_END)


def left_out_why(run: Run, model: dict) -> str | None:
    """Why a run is not of the model files `model` (the folder's model_fingerprint); None: it is."""
    recorded = run.model_files
    if recorded == model:
        return None
    if not isinstance(recorded, dict) or not recorded:
        return "its results.json records no model files"
    if set(recorded) == LOADED:
        return (f"it evaluated a model loaded in Python ({run.model}), which is not matched with files: evaluate "
                "the folder by its path")
    if "hub" in recorded:
        return f"it evaluated the hub model {recorded['hub']}"
    names = differences(recorded, model)
    listed = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"it evaluated {run.model}, whose {listed} differ from the folder's"


def add_results(folder: Path | str, run_folders: list[str]) -> tuple[Path, list[str]]:
    """The tables and plots of the runs of the folder's model in its card; returns the card's path and, for each run
    left out (another model's), "RUN_DIR (why)". Everything is read and checked first (none of the runs of this
    model: a ValueError); the plots are drawn in a new folder that replaces DIR/PLOTS, then the card is replaced
    whole. A folder that cannot be written is a ValueError, and leaves the card as it was."""
    readme = check_card(folder)
    read = [(r, read_run(r)) for r in run_folders]
    model = model_fingerprint(str(folder))
    why = {r: left_out_why(run, model) for r, run in read}
    left_out = [f"{r} ({why[r]})" for r, _ in read if why[r]]
    runs = [run for r, run in read if not why[r]]
    if not runs:
        raise ValueError(f"none of the runs evaluated the model in {folder}: {'; '.join(left_out)}")
    try:
        _write(Path(folder), readme, runs, model)
    except OSError as e:
        raise ValueError(f"cannot write the card of {folder}: {describe_os_error(e)}") from None
    return readme, left_out


def _write(folder: Path, readme: Path, runs: list[Run], model: dict) -> None:
    plots = plot_names(runs)
    card = with_results(readme.read_text(encoding="utf-8"), runs, plots, model)
    target = Path(folder) / PLOTS
    staged, old = target.with_name(PLOTS + ".partial"), target.with_name(PLOTS + ".old")
    for leftover in (staged, old):  # an interrupted run's
        shutil.rmtree(leftover, ignore_errors=True)
    staged.mkdir()
    try:
        for run, plot in zip(runs, plots, strict=True):
            if run.plot is not None and plot is not None:
                run.draw(Path(folder) / plot.replace(PLOTS, staged.name, 1))
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    if target.exists():
        os.replace(target, old)
    if any(staged.iterdir()):
        os.replace(staged, target)
    else:  # no run drew a plot: no folder of them
        staged.rmdir()
    try:
        write_file(readme, lambda tmp: tmp.write_text(card, encoding="utf-8"))
    except BaseException:  # the card as it was: its plots back with it
        shutil.rmtree(target, ignore_errors=True)
        if old.exists():
            os.replace(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)
