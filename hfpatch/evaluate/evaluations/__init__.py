"""One module per evaluation, named as its command (`hfpatch eval NAME`): it defines EVALUATION, an instance of a
subclass of definition.Evaluation that owns the evaluation's arguments, generator, scoring, cell axes, tables and
plot (docs/extending.md). The sweep (evaluate/sweep.py) runs it, and hands each unit the model operations it needs
(run.greedy, run.document_nll): a module here imports no torch, so that its --help answers at once.

The folder lists itself: EVALUATIONS is read from it without importing the modules (so `hfpatch --help` stays fast),
and `evaluation(name)` imports the one asked for; hfpatch.evaluate re-exports both.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..definition import Evaluation

EVALUATIONS = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.ispkg))


def evaluation(name: str) -> Evaluation:
    """The EVALUATION (a definition.Evaluation) of `hfpatch eval NAME`; ValueError for a name that is none."""
    if name not in EVALUATIONS:
        raise ValueError(f"unknown evaluation {name!r}; the evaluations: {', '.join(EVALUATIONS)}")
    return importlib.import_module(f"{__name__}.{name}").EVALUATION
