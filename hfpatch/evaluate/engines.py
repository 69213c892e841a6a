"""The engines that run an evaluation's model (`hfpatch eval NAME --engine ENGINE`): the `Engine` protocol the sweep
(sweep.py) calls, the `Scorer` protocol of the model an evaluation's units read through the run (`run.greedy`,
`run.document_nll`), and ENGINES, the one registry of engines. The command line (--engine's choices and help), the
sweep and the documentation's table of engines (docs/generated/eval_engines.md) all read ENGINES.

hfpatch's three engines are registered below by the module and class that hold them (transformers_engine.py,
llamacpp.py, vllm_engine.py), imported when a run needs one: this module imports neither torch nor an engine, so
that `hfpatch eval NAME --help` answers at once. An engine from elsewhere registers its class:

    from hfpatch.evaluate import engines
    engines.register("mine", MyEngine, "what runs the model, and how a patch spec reaches it")

after which `--engine mine` (and `hfpatch.evaluate.run(..., engine="mine")`) runs every evaluation in it.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from ..registry import Registry
from .plan import Plan


class Scorer(Protocol):
    """The model as an evaluation's units use it, whichever engine runs it: what `Engine.prepare` returns, and what
    the run's `greedy` and `document_nll` call (lm.causal.LMParts for transformers, the engine's own model for
    llama.cpp and vLLM)."""

    def document_nll(self, ids: Sequence[int], spans: list[tuple[int, int, int]], chunk: int = 1024,
                     progress: Callable[[int], None] | None = None) -> tuple[float, int, list[tuple[int, int]]]:
        """(nll sum, tokens scored, runs of scored token indices) over the windows (start, end, first scored) of
        `ids`; `chunk`: positions per LM-head chunk, where the engine computes the head itself; progress(n) is told
        the tokens read after each window."""
        ...

    def greedy(self, ids: list[int], new_tokens: int, eos: set[int],
               done: Callable[[list[int]], bool] | None = None) -> list[int]:
        """Greedy decoding of `ids`: up to new_tokens, an EOS token, or done(generated) returning True."""
        ...


class Engine(Protocol):
    """What the sweep calls to check, load, patch and time the model of a run. A class is registered; the sweep
    makes one per run from the parsed arguments, after refusing the model options it does not read."""

    name: ClassVar[str]  # --engine NAME; a results file of another engine than transformers records it
    # the model options (transformers_engine.MODEL_OPTIONS: dtype, device, device_map) it reads; the others are
    # refused with `unread_reason` rather than recorded as if they had run
    reads: ClassVar[frozenset[str]]
    unread_reason: ClassVar[str]
    runs_python: ClassVar[bool]  # whether it runs in another Python, which --engine-python names

    def __init__(self, args: argparse.Namespace) -> None: ...

    def check_longest_read(self, args: argparse.Namespace, shape: Any = None) -> None:
        """Refuse, before the tokenizer builds any prompt, a longest read (args.lengths) that cannot fit (`shape`:
        the loaded model's lm.budget.Shape, or None to read it from the config)."""
        ...

    def check_memory(self, args: argparse.Namespace, plan: Plan, shape: Any = None) -> None:
        """Refuse, before the model loads, a plan whose longest read, generation included, cannot fit."""
        ...

    def load(self, args: argparse.Namespace) -> Any:
        """The engine's model, loaded by name (args.model)."""
        ...

    def prepare(self, model: Any, patches: list[tuple[str, dict]], plan: Plan, results: Any, name: str) -> Scorer:
        """Check every patch spec against the model before any work (one that cannot run fails now), record what
        runs in results.data["model"] (`results`: the sweep's results.Results), and return the model's Scorer."""
        ...

    def estimate(self, ev: Any, run: Any, plan: Plan, todo: list) -> float:
        """Seconds the work left (`todo`) will take, printed before it starts (`ev`, `run`: the sweep's evaluation
        and Run)."""
        ...

    def applied(self, model: Any, kwargs: dict, name: str) -> AbstractContextManager[Any]:
        """The patch spec `name` (`hfpatch.patch` keyword arguments `kwargs`) applied to the model for a while."""
        ...

    def paths_ran(self, model: Any) -> dict[str, int]:
        """Calls per attention path so far, where the engine can say which of hfpatch's kernels ran ({} if not)."""
        ...


@dataclass(frozen=True)
class EngineRecord:
    """One engine of ENGINES: what --help and the docs say of it, and its class (imported on first use when given
    as "module:Class")."""

    name: str  # --engine NAME
    summary: str  # what runs the model, and how a patch spec reaches it
    needs: str  # what it needs installed besides hfpatch ("" for nothing)
    source: type[Engine] | str  # the class, or "package.module:Class"

    def load(self) -> type[Engine]:
        """The engine's class, its module imported now if the record names it."""
        if isinstance(self.source, str):
            module, _, attribute = self.source.partition(":")
            found = getattr(importlib.import_module(module), attribute)
        else:
            found = self.source
        _check_class(self.name, found)
        return found


ENGINES: Registry[EngineRecord] = Registry("evaluation engine")
DEFAULT = "transformers"  # the engine a command runs without --engine
# what an engine class must have, read off the protocol: checked when a class is registered or loaded
MEMBERS = tuple(sorted({*Engine.__annotations__,
                        *(k for k, v in vars(Engine).items() if callable(v) and not k.startswith("_"))}))


def register(name: str, engine: type[Engine] | str, summary: str, needs: str = "") -> EngineRecord:
    """Make `engine` --engine NAME of every evaluation: its class (whose `name` is `name`), or "package.module:Class"
    to import when a run needs it. ValueError for a name registered already or a class of another name; TypeError
    for what is not an engine class (it lacks a member of the Engine protocol)."""
    if isinstance(engine, str):
        if ":" not in engine:
            raise ValueError(f"engine {name!r}: {engine!r} is not 'package.module:Class'")
    else:
        _check_class(name, engine)
    return ENGINES.register(name, EngineRecord(name, summary, needs, engine))


def engine_class(name: str) -> type[Engine]:
    """The class of --engine NAME; ValueError (registry.UnknownName) naming the engines for a name that is none."""
    return ENGINES[name].load()


def help_text() -> str:
    """--engine's help: every engine, in registration order, with its summary and what it needs."""
    return "; ".join(f"{r.name}{' (default)' if r.name == DEFAULT else ''}: {r.summary}"
                     + (f" (needs {r.needs})" if r.needs else "") for r in ENGINES.values())


def _check_class(name: str, engine: Any) -> None:
    """TypeError for what is not an engine class (one that lacks a member of the protocol), ValueError for a class
    whose `name` is another."""
    if not isinstance(engine, type):
        raise TypeError(f"engine {name!r}: an engine is a class (its instances run the model), got "
                        f"{type(engine).__name__}")
    missing = [m for m in MEMBERS if not hasattr(engine, m)]
    if missing:
        raise TypeError(f"engine {name!r}: {engine.__name__} lacks {', '.join(missing)} of the Engine protocol "
                        f"(hfpatch.evaluate.engines.Engine: {', '.join(MEMBERS)})")
    named = getattr(engine, "name", None)
    if named != name:
        raise ValueError(f"engine {name!r}: its class {engine.__name__} is named {named!r}; register it under its "
                         "own name")


register(DEFAULT, f"{__package__}.transformers_engine:TransformersEngine",
         "the model loaded by transformers and patched by hfpatch in this process")
register("llama.cpp", f"{__package__}.llamacpp:LlamaCppEngine",
         "the same cells run by llama.cpp on the GGUF file, specs applied as its RoPE metadata",
         needs="pip install 'hfpatch[llama-cpp]'")
register("vllm", f"{__package__}.vllm_engine:VllmEngine",
         "the same cells run by vLLM on the folder hfpatch.save_pretrained writes for each spec",
         needs="vLLM, in a Python of its own: --engine-python")
