"""One module per evaluation, named as its command (`hfpatch eval NAME`): it defines EVALUATION, an instance of a
subclass of definition.Evaluation that owns the evaluation's arguments, generator, scoring, cell axes, tables and
plot (docs/extending.md). The sweep (evaluate/sweep.py) runs it, and hands each unit the model operations it needs
(run.greedy, run.document_nll): a module here imports no torch, so that its --help answers at once.

EVALUATIONS is the one registry of evaluations, which `hfpatch eval`, `hfpatch.evaluate.run` and `hfpatch card`
read. The folder registers itself: every module here, by name, without importing it (so `hfpatch --help` stays
fast); `evaluation(name)` imports the one asked for, and hfpatch.evaluate re-exports both. An evaluation from
elsewhere registers its module, or its EVALUATION:

    from hfpatch.evaluate import evaluations
    evaluations.register("echo", "mypackage.echo")  # the module that defines EVALUATION, imported when it runs

after which `hfpatch eval echo` (in that process) and `hfpatch.evaluate.run("echo", ...)` run it.
"""

from __future__ import annotations

import importlib
import pkgutil

from ...registry import Registry
from ..definition import Evaluation

# name -> the evaluation: its module's name (imported when it runs), or its EVALUATION
EVALUATIONS: Registry[Evaluation | str] = Registry.of("evaluation", {
    m.name: f"{__name__}.{m.name}" for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name)
    if not m.ispkg})


def register(name: str, evaluation: Evaluation | str) -> Evaluation | str:
    """Make `evaluation` `hfpatch eval NAME` and `hfpatch.evaluate.run(NAME, ...)`: its EVALUATION (an instance of a
    definition.Evaluation subclass), or the name of the module that defines it ("package.module", imported when it
    runs). An evaluation is named as its module. ValueError for a name registered already or an evaluation of
    another name; TypeError for what is neither."""
    if isinstance(evaluation, str):
        if evaluation.rpartition(".")[2] != name:
            raise ValueError(f"evaluation {name!r}: its module {evaluation!r} gives it the name "
                             f"{evaluation.rpartition('.')[2]!r} (an evaluation is named as its module); register "
                             "it under its own name")
    else:
        _check(name, evaluation)
    return EVALUATIONS.register(name, evaluation)


def evaluation(name: str) -> Evaluation:
    """The EVALUATION (a definition.Evaluation) of `hfpatch eval NAME`; ValueError for a name that is none."""
    if not isinstance(name, str) or name not in EVALUATIONS:
        raise ValueError(f"unknown evaluation {name!r}; the evaluations: {', '.join(EVALUATIONS)}")
    source = EVALUATIONS[name]
    found = importlib.import_module(source).EVALUATION if isinstance(source, str) else source
    _check(name, found)
    return found


def _check(name: str, evaluation: object) -> None:
    """TypeError for what is not an evaluation, ValueError for one named otherwise (its module's name)."""
    if not isinstance(evaluation, Evaluation):
        raise TypeError(f"evaluation {name!r}: an evaluation is an instance of a subclass of "
                        f"hfpatch.evaluate.definition.Evaluation, got {type(evaluation).__name__}")
    if evaluation.name != name:
        raise ValueError(f"evaluation {name!r}: {type(evaluation).__name__} is named {evaluation.name!r}, as its "
                         "module is; register it under its own name")
