"""What an evaluation is, as its module (evaluate/evaluations/NAME.py) sees it: the `Evaluation` base class, its
command line (`build_parser`: the options every evaluation shares, then its own), and the plan it makes of its
cells and units (`Plan`, `Cell`, `Unit`, `decoding`, from plan.py, importable from here). The command runs the plan
through the sweep (sweep.py), which imports none of this module: it reads an evaluation through its own protocol.

This module and what it imports load neither torch nor transformers: an evaluation module imports it at its top,
and `hfpatch eval NAME --help` (and the parsing of its arguments, with the errors of a bad flag) answers at once; the
sweep is imported once the arguments parse. The model operations a unit needs come from the run the sweep hands it
(`run.greedy`, `run.document_nll`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from ..utils import command
from . import engines
from .plan import Cell as Cell  # importable from here too
from .plan import Plan as Plan  # importable from here too
from .plan import Unit as Unit  # importable from here too
from .plan import decoding as decoding  # importable from here too


class Evaluation:
    """One evaluation; its module (evaluate/evaluations/NAME.py) gives it its name, and the first paragraph of the
    module's docstring its description."""

    records: str = "records"  # the cell field with one record per unit
    unit_key: str = "id"  # the record field that holds the unit's id
    default_patches: str = "none,yarn:2"
    # the cells' coordinates besides the patch spec: settings key -> the cell field it lists (numeric ones are shown
    # sorted, the others in the order they were run)
    axes: ClassVar[dict[str, str]] = {}

    @property
    def name(self) -> str:
        """hfpatch eval NAME: the name of its module."""
        return type(self).__module__.rpartition(".")[2]

    @property
    def kind(self) -> str:
        """The results file's kind."""
        return self.name

    @property
    def description(self) -> str:
        return (sys.modules[type(self).__module__].__doc__ or "").split("\n\n")[0]

    @property
    def default_out(self) -> str:
        return f"runs/{self.name}"

    @property
    def plot_name(self) -> str:
        """The plot's file under --out."""
        return f"{self.name}.png"

    @property
    def prog(self) -> str:
        return f"hfpatch eval {self.name}"

    def main(self, argv: list[str] | None = None) -> int:
        """The command: hfpatch eval NAME ARGS."""
        return main(self, argv)

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        pass

    def plan(self, args: argparse.Namespace, tok: Any) -> Plan:
        raise NotImplementedError

    def run_unit(self, run: Any, cell: dict, unit: Unit, progress: Callable[[int], None]) -> dict:
        """Run one unit with the cell's spec applied; return its record. progress(n) may report tokens read. `run`
        is the sweep's Run: the model, its tokenizer and the args, and the model operations the unit calls
        (run.greedy, run.document_nll), whichever engine runs the model."""
        raise NotImplementedError

    def summarize(self, records: list[dict]) -> dict:
        """A finished cell's numbers: a pure function of its records (the results file is checked with it)."""
        raise NotImplementedError

    def caption(self, data: dict) -> str:
        """One line above the tables, and the plot's title: what was measured on what."""
        raise NotImplementedError

    def tables(self, data: dict) -> str:
        """The Markdown tables of a results file's data."""
        raise NotImplementedError

    def plot(self, data: dict, path: Path, title: str) -> None:
        """The plot of a results file's data, written to `path`."""
        raise NotImplementedError


def build_parser(ev: Evaluation) -> command.Parser:
    p = command.Parser(prog=ev.prog, description=ev.description)
    p.add_argument("--model", default="smollm2",
                   help="hub id, local folder, .gguf file, or smollm2 (the embedded default; default)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16", "auto"],
                   help="weights dtype (default fp32; auto = the checkpoint's); transformers engine only")
    p.add_argument("--device-map", dest="device_map",
                   help="'auto' shards the model over the GPUs present (accelerate big-model inference); "
                        "transformers engine only")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu); "
                                    "ignored with --device-map; transformers engine only")
    p.add_argument("--engine", default=engines.DEFAULT, choices=list(engines.ENGINES),
                   help=f"what runs the model: {engines.help_text()}")
    p.add_argument("--engine-python", dest="engine_python",
                   help="--engine vllm: the Python of the environment vLLM is installed in (default: "
                        "$HFPATCH_VLLM_PYTHON, else ~/.cache/hfpatch/vllm/bin/python)")
    p.add_argument("--patches", default=ev.default_patches,
                   help="comma-separated patch specs, each applied to the same loaded model and removed again: "
                        "none, yarn:2, ntk:2, dynamic, linear:2, yarn:4:beta_fast=16, ... "
                        f"(default {ev.default_patches})")
    ev.add_arguments(p)
    p.add_argument("--out", default=ev.default_out,
                   help=f"folder for results.json, table.md and the plot (default {ev.default_out})")
    p.add_argument("--overwrite", action="store_true", help="discard an existing results file instead of resuming")
    p.add_argument("--no-plot", action="store_true", dest="no_plot")
    p.add_argument("--dry-run", action="store_true", dest="dry_run",
                   help="validate, check memory, load the model and print the time estimate; run nothing and "
                        "write nothing")
    p.add_argument("--no-memory-check", action="store_true", dest="no_memory_check",
                   help="run even when the estimated memory exceeds what is free")
    return p


def refuse_empty(args: argparse.Namespace) -> None:
    """A setting given as empty text, an empty list or a list holding empty text is refused rather than taken as
    left out (an empty --out would write into the current folder, an empty --text-files read the default corpus)."""
    for key, value in vars(args).items():
        items = value if isinstance(value, list) else [value]
        if (isinstance(value, list) and not value) or any(isinstance(v, str) and not v.strip() for v in items):
            raise ValueError(f"--{key.replace('_', '-')} is empty ({value!r}): give a value, or leave it out for its "
                             "default")


# The most trials or samples per cell (--trials, --samples): results.json is rewritten after each one, so a run of
# more would spend its time rewriting it (and a count such as 2**63 never finished planning).
MAX_PER_CELL = 100_000


def check_count(flag: str, value: int, high: int | None = MAX_PER_CELL) -> None:
    """A count option (trials, samples, tokens): >= 1 and, where `high` is given, at most `high`."""
    if value < 1 or (high is not None and value > high):
        bound = f" and at most {high}" if high is not None else ""
        raise ValueError(f"{flag} must be >= 1{bound}, got {value}")


def main(ev: Evaluation, argv: list[str] | None = None) -> int:
    return command.run_main(lambda a: _main(ev, a), argv, ev.prog,
                        interrupted="run the same command again to resume from the results file")


def _main(ev: Evaluation, argv: list[str] | None) -> int:
    args = build_parser(ev).parse_args(argv)
    refuse_empty(args)
    # the CLI's lazy loading: --help and bad flags answered above, without torch; the sweep that runs the model
    # (torch, transformers, the engines) is imported only for a command that will run (it imports nothing of this
    # module back: no cycle)
    from .sweep import execute

    data = execute(ev, args, record_argv=list(sys.argv[1:] if argv is None else argv))
    if data is not None:
        print(data["report"])
    return 0
