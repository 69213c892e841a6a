"""The evaluations' default engine: the model loaded by transformers and patched by hfpatch in this process, as the
sweep (sweep.py) calls it — the memory checks before loading, the check of every spec against learned position
tables, the time estimate from one timed forward, and the attention paths the model ran. The other engines are
llamacpp.py and vllm_engine.py; engines.ENGINES names all three, and engines.Engine is what each of them is.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from .. import spec as specs
from ..adapters.positions import trained_window
from ..apply import loaded_with, unwrap
from ..introspect import describe, table_limit
from ..lm import budget
from ..lm.causal import LMParts, causal_lm_parts
from .common import applied, load_model, parse_lengths
from .engines import Engine
from .results import Results


class Reads(Protocol):
    """What the checks read of the sweep's Plan: the longest read, the tokens generated after it, the LM-head
    chunk when scoring."""

    read: int
    new_tokens: int
    score_chunk: int


# The options of how the model is loaded, with their defaults: the parser leaves them None, so that an option given
# on the command line is told from one left out. An engine reads those it names in `reads` and refuses the others
# rather than record settings it did not run with.
MODEL_OPTIONS = {"dtype": "fp32", "device": None, "device_map": None}


def check_longest_read(args: argparse.Namespace, shape: budget.Shape | None = None) -> None:
    """The memory check of the longest --lengths alone, before the tokenizer builds any prompt: a prompt of
    millions of tokens takes the tokenizer minutes and more memory than the machine has (it aborted the process at
    100000k). The full check, with the plan's generation and scoring, follows the plan."""
    if getattr(args, "lengths", None):
        check_reads(args, max(parse_lengths(args.lengths)), getattr(args, "new_tokens", 0) or 0, 0, shape)


def check_memory(args: argparse.Namespace, plan: Reads, shape: budget.Shape | None = None) -> None:
    """Refuse, before loading the model, a run whose longest read cannot fit in the memory that is free (`shape`:
    the model's, when it is loaded already; else read from its config by name)."""
    check_reads(args, plan.read, plan.new_tokens, plan.score_chunk, shape)


def check_reads(args: argparse.Namespace, read: int, new_tokens: int, score_chunk: int,
                shape: budget.Shape | None = None) -> None:
    """check_memory of a read of `read` tokens, `new_tokens` generated after it, `score_chunk` positions per
    LM-head chunk."""
    shape = shape or budget.shape_of(args.model)
    free, where = budget.available_memory(args.device, args.device_map)
    if shape is None or free is None:
        return
    b = {"fp16": 2, "bf16": 2}.get(args.dtype, 4)

    def need(tokens) -> dict:
        return budget.memory_needed(shape, b, tokens, new_tokens, score_chunk)

    parts = need(read)
    if parts["total"] <= free:
        return
    fits = 0
    lo, hi = 1, read
    while lo <= hi:  # the longest read that fits, for the message
        mid = (lo + hi) // 2
        if need(mid)["total"] <= free:
            fits, lo = mid, mid + 1
        else:
            hi = mid - 1
    detail = ", ".join(f"{k} {budget.gb(v)}" for k, v in parts.items() if k != "total")
    fewer = ", fewer --new-tokens" if getattr(args, "new_tokens", None) else ""  # the flag's, where there is one
    raise ValueError(f"reading {read} tokens needs about {budget.gb(parts['total'])} ({detail}) but "
                     f"{budget.gb(free)} is free on the {where}; up to about {fits} tokens fit: use shorter "
                     f"lengths{fewer}, --dtype bf16, or --no-memory-check to try anyway")


def _prepare(model: Any, patches: list[tuple[str, dict]], plan: Reads, results: Results, name: str) -> LMParts:
    parts = causal_lm_parts(model)  # a clear error for masked LMs before anything runs
    need = plan.read + plan.new_tokens
    for spec, kwargs in patches:  # apply and remove each spec once: one that does not fit fails before any work
        with applied(model, kwargs, spec):
            limit = table_limit(model)
        if limit is not None and need > limit:
            extra = f" (+ {plan.new_tokens} generated)" if plan.new_tokens else ""
            raise ValueError(f"patch {spec!r}: the model has learned positions for {limit} tokens only, so "
                             f"{plan.read} tokens{extra} cannot run; use lengths <= {limit - plan.new_tokens}")
    target = unwrap(model)
    loaded = loaded_with(target)
    results.data["model"] = {"name": name, "loaded_with": specs.describe_string(loaded) if loaded else None,
                             "class": type(target).__name__, "model_type": target.config.model_type,
                             "trained_window": trained_window(target.config),
                             "dtype": str(next(target.parameters()).dtype).replace("torch.", ""),
                             "parameters": sum(p.numel() for p in target.parameters())}
    return parts


def _estimate(ev: Any, run: Any, plan: Reads, todo: list) -> float:
    """Seconds the work left will take, from the cost model and one timed forward; printed before it starts (`ev`,
    `run`: the sweep's Evaluation and Run)."""
    shape = budget.shape_of_config(unwrap(run.model).config)
    limit = table_limit(run.model)  # unpatched now: stay within its table, the decoding step included
    n = min(max(16, min(1024, plan.read)), limit - 1 if limit else plan.read + 16)
    speed = budget.measure_speed(run.parts, shape, n)
    units = [u for *_, left in todo for u in left]
    seconds = sum(speed.seconds(shape, *f) for u in units for f in u.forwards)
    tokens = sum(u.tokens for u in units)
    print(f"{ev.prog}: {budget.work_left(ev.records, todo)} and {tokens:,} tokens to read: about "
          f"{budget.duration(seconds)} here (estimated from a timed {n}-token forward: "
          f"{speed.flops_per_s / 1e9:.0f} GFLOP/s, {speed.step_s * 1e3:.0f} ms per decoding step)", file=sys.stderr)
    return seconds


def _paths_ran(model: Any) -> dict:
    """Calls per attention path so far, for schemes with their own attention function (describe())."""
    return describe(model)["position"].get("attention_path", {}).get("ran", {})


class TransformersEngine:
    """The default engine: the model loaded and patched by transformers and hfpatch (the functions above)."""

    name: ClassVar[str] = "transformers"
    reads: ClassVar[frozenset[str]] = frozenset(MODEL_OPTIONS)
    unread_reason: ClassVar[str] = ""
    runs_python: ClassVar[bool] = False

    def __init__(self, args: argparse.Namespace) -> None:
        pass

    check_longest_read = staticmethod(check_longest_read)
    check_memory = staticmethod(check_memory)
    load = staticmethod(load_model)
    prepare = staticmethod(_prepare)
    estimate = staticmethod(_estimate)
    applied = staticmethod(applied)
    paths_ran = staticmethod(_paths_ran)


_conforms: Callable[[argparse.Namespace], Engine] = TransformersEngine  # mypy checks it is an engines.Engine
