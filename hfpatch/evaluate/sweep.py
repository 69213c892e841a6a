"""The one loop every evaluation runs, so that adding an evaluation is writing one file (evaluate/evaluations/).

An evaluation (a subclass of definition.Evaluation) says what its cells and units of work are, how to run one
unit, and how its results read as tables and a plot; the sweep does the rest, the same way for all of them:
  1. parse the command line (the model, dtype, device and patch-spec flags are common), validate everything, plan
     the cells — all before the model is loaded, so bad input is one line and exit 2 at once;
  2. open OUT/results.json: the same identity continues it (finished units are not run again), another is refused;
     the identity holds the model's files by content (config, weights, tokenizer), so other weights copied to the
     same path are refused too;
  3. refuse lengths whose memory cannot fit (estimated from the config, before loading);
  4. load the model once; apply and remove every spec once (a spec that does not fit fails now), check learned
     position tables against the longest read; time one forward and print how long the work left will take;
  5. for each spec: patch, run its cells unit by unit (the file is rewritten atomically after every unit), unpatch;
  6. write the Markdown table (also printed) and the plot, from the results file alone.

Cells are keyed by (patch spec, the evaluation's coordinates); units run in a fixed order, so a cell's records
are always a prefix of its units and resuming continues after the last one.

The sweep reads an evaluation through `Swept` (definition.Evaluation is one) and an engine through engines.Engine;
it imports neither definition.py nor an engine module, so that nothing it imports imports it back.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from tqdm.auto import tqdm

from ..apply import unwrap
from ..lm import budget
from ..lm.tokenizer import load_tokenizer
from ..models import model_fingerprint
from ..utils.files import write_text
from ..utils.modes import evaluating
from . import engines
from .common import DTYPES, check_device, dtype_name, length_label, parse_patches, versions
from .plan import Cell as Cell  # importable from here too
from .plan import Plan
from .plan import Unit as Unit  # importable from here too
from .plan import decoding as decoding  # importable from here too
from .results import Results, now
from .transformers_engine import MODEL_OPTIONS
from .transformers_engine import check_longest_read as check_longest_read  # importable from here too
from .transformers_engine import check_memory as check_memory  # importable from here too


class Swept(Protocol):
    """What the sweep reads of an evaluation (definition.Evaluation, which documents each member, is one)."""

    records: str  # the cell field with one record per unit
    unit_key: str  # the record field that holds the unit's id
    axes: ClassVar[dict[str, str]]  # settings key -> the cell field it lists

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def prog(self) -> str: ...

    @property
    def plot_name(self) -> str: ...

    def plan(self, args: argparse.Namespace, tok: Any) -> Plan: ...

    def run_unit(self, run: Any, cell: dict, unit: Unit, progress: Callable[[int], None]) -> dict: ...

    def summarize(self, records: list[dict]) -> dict: ...

    def caption(self, data: dict) -> str: ...

    def tables(self, data: dict) -> str: ...

    def plot(self, data: dict, path: Path, title: str) -> None: ...


@dataclass
class Run:
    """What run_unit gets: the loaded model (patched with the cell's spec), its scorer and tokenizer, the args, and
    the model operations a unit calls (greedy, document_nll), whichever engine runs the model: an evaluation module
    calls them here instead of importing lm.causal, which imports torch."""

    model: object
    parts: engines.Scorer  # what the engine's prepare() returned: lm.causal.LMParts, or the engine's own model
    tok: object
    args: object
    applied: Callable[..., Any]  # (model, kwargs, spec name) -> context manager: the engine's way to patch
    paths_ran: Callable[[Any], dict]  # model -> {attention path: calls so far}, what the engine can say of its kernels

    def greedy(self, ids: list[int], new_tokens: int, eos: set[int], done: Any = None) -> list[int]:
        """Greedy decoding of `ids` by the engine's model: up to new_tokens, an EOS token, or done(generated)
        returning True."""
        return self.parts.greedy(ids, new_tokens, eos, done=done)

    def document_nll(self, ids: Any, windows: list[tuple[int, int, int]], chunk: int = 1024,
                     progress: Any = None) -> tuple[float, int, list[tuple[int, int]]]:
        """(nll sum, tokens scored, runs of scored token indices) over the windows of `ids`, by the engine's model;
        progress(n) is told the tokens read after each window."""
        return self.parts.document_nll(ids, windows, chunk=chunk, progress=progress)


@dataclass
class Given:
    """A model the caller loaded itself (the Python API, `hfpatch.evaluate.run`): it is evaluated as it is, with its
    tokenizer, instead of a model loaded by name."""

    model: Any
    tokenizer: Any
    name: str  # what the results call it


def execute(ev: Swept, args: argparse.Namespace, *, record_argv: list | None = None,
            given: Given | None = None) -> dict | None:
    """Run evaluation `ev` with the parsed settings `args` (the command line's, or the Python API's): validate, plan,
    resume or start the results file, check memory, load (or take `given`), estimate, run every unit left, report.
    Returns the results file's content with the Markdown report under "report" (None after a dry run)."""
    patches = parse_patches(args.patches)  # every spec validated before any loading
    if given is not None:
        check_given_options(args, given.model)
    engine = make_engine(args)
    shape = budget.shape_of_config(unwrap(given.model).config) if given else None
    if not args.no_memory_check:
        engine.check_longest_read(args, shape)
    tok = given.tokenizer if given else load_tokenizer(args.model)
    plan = ev.plan(args, tok)
    # what is evaluated, by content: a model's files (not only its path), or a loaded model's config and weights
    plan.identity["model_files"] = loaded_fingerprint(given.model, tok) if given else model_fingerprint(args.model)
    out = Path(args.out)
    # another engine's numbers are other numbers: its results file is not continued by transformers, nor the reverse
    identity = plan.identity if engine.name == engines.DEFAULT else {**plan.identity, "engine": engine.name}
    results = Results(out / "results.json", ev.kind, identity, ev.records, ev.summarize, args.overwrite,
                      read_only=args.dry_run)
    try:
        if results.resumed:
            print(f"{ev.prog}: resuming from {out / 'results.json'}", file=sys.stderr)
        results.data.update(plan.info, versions=versions())
        results.data.setdefault("settings", {}).update(patches=[p for p, _ in patches], argv=record_argv)
        todo = _todo(ev, results, plan, patches)
        if todo:
            if not args.no_memory_check:
                engine.check_memory(args, plan, shape)
            model = given.model if given else engine.load(args)
            # an engine's model may hold processes and files (vLLM's worker and folders); a torch model is measured
            # in eval mode (dropout off), whatever mode a caller's model was in, and given back in its own modes
            with _closing(model), _evaluating(model):
                run = Run(model, engine.prepare(model, patches, plan, results, given.name if given else args.model),
                          tok, args, engine.applied, engine.paths_ran)
                estimate = engine.estimate(ev, run, plan, todo)
                if args.dry_run:  # writes nothing: a dry run with other settings must not decide the real run's file
                    return None
                results.data.setdefault("runs", []).append({"started": now(), "estimate_s": round(estimate, 1)})
                results.save()
                t0 = time.perf_counter()
                _run(ev, run, todo, results)
            took = time.perf_counter() - t0
            results.data["runs"][-1].update(seconds=round(took, 1), finished=now())
            results.save()
            print(f"{ev.prog}: took {budget.duration(took)} (estimated {budget.duration(estimate)})",
                  file=sys.stderr)
        elif args.dry_run:
            print(f"{ev.prog}: nothing left to run in {out / 'results.json'}", file=sys.stderr)
            return None
        data = covering(ev, results.data)
        text = report(ev, data, out, not args.no_plot)
        write_text(out / "table.md", text + "\n")
        return {**data, "report": text}
    finally:
        results.close()


def make_engine(args: argparse.Namespace) -> engines.Engine:
    """The engine --engine names, made from the parsed arguments once the options it would not read are refused."""
    engine_class = engines.engine_class(args.engine)
    check_engine_options(args, engine_class)
    if args.engine_python and not engine_class.runs_python:
        raise ValueError(f"--engine-python names the Python that runs --engine vllm; --engine {args.engine} runs "
                         "in this one: leave it out")
    return engine_class(args)


def loaded_fingerprint(model: Any, tokenizer: Any) -> dict:
    """What identifies a model the caller loaded, by content: the SHA-256 of its config (with any patch it carries)
    and of every parameter and buffer, and of its tokenizer's vocabulary and chat template."""
    target = unwrap(model)
    weights = hashlib.sha256()
    for name, tensor in sorted(target.state_dict().items()):
        weights.update(name.encode())
        weights.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    template = getattr(tokenizer, "chat_template", None) or ""
    return {"config": hashlib.sha256(target.config.to_json_string().encode()).hexdigest(),
            "weights": weights.hexdigest(),
            "tokenizer": hashlib.sha256((vocab + "\0" + str(template)).encode()).hexdigest()}


@contextlib.contextmanager
def _closing(model) -> Iterator[Any]:
    """The engine's model, closed at the end if it can be (a transformers model has nothing to close)."""
    try:
        yield model
    finally:
        close = getattr(model, "close", None)
        if callable(close) and not isinstance(model, torch.nn.Module):
            close()


def _evaluating(model: Any) -> contextlib.AbstractContextManager:
    """The model in eval mode for the run (utils.modes.evaluating) where it is a torch module; another engine's
    model as it is."""
    return evaluating(model) if isinstance(model, torch.nn.Module) else contextlib.nullcontext()


def report(ev: Swept, data: dict, out: Path, plot: bool) -> str:
    """The caption and tables of a results file's data (and its plot, written under `out`)."""
    caption = ev.caption(data) + loaded_note(data)
    if plot:
        ev.plot(data, out / ev.plot_name, caption)
        print(f"\nplot: {out / ev.plot_name}; results: {out / 'results.json'}", file=sys.stderr)
    return f"{caption}\n\n{ev.tables(data)}"


def loaded_note(data: dict) -> str:
    """What the caption says of a model loaded patched (a folder saved with yarn:4, a GGUF with RoPE scaling): the
    `none` row is that model, and every other spec replaced its patch."""
    loaded = data.get("model", {}).get("loaded_with")
    if not loaded:
        return ""
    return (f" (loaded with {loaded}: `none` is the model as loaded; each other spec replaces that patch on the "
            "axes it names)")


def covering(ev: Swept, data: dict) -> dict:
    """The results with settings widened to every cell the file holds, for the report: a command that resumed a
    results file to add one spec or one length (e.g. `dynamic` only at 16k) shows the whole table, the cells it
    did not run included, instead of its own slice. The file itself keeps the command's settings."""
    cells, settings = data.get("cells", []), dict(data.get("settings", {}))
    for key, column in {"patches": "patch", **ev.axes}.items():
        if isinstance(settings.get(key), list):
            values = list(dict.fromkeys([*(c[column] for c in cells if column in c), *settings[key]]))
            numeric = all(isinstance(v, (int, float)) for v in values)
            settings[key] = sorted(values) if numeric else values
    return {**data, "settings": settings}


def _todo(ev: Swept, results: Results, plan: Plan, patches: list[tuple[str, dict]]) -> list:
    """[(spec, kwargs, Cell, units left)] for every cell not finished, in run order (grouped by spec)."""
    todo = []
    for spec, kwargs in patches:
        for c in plan.cells:
            stored = results.find({"patch": spec, **c.key})
            records = stored[ev.records] if stored else []
            ids = [r.get(ev.unit_key) for r in records[: len(c.units)]]
            if ids != [u.id for u in c.units[: len(ids)]]:
                raise ValueError(f"{results.path}: cell {spec} {c.key} holds {ev.records} {ids}, not the planned "
                                 f"{[u.id for u in c.units[:len(ids)]]}; use another --out, or --overwrite")
            left = c.units[len(records):]
            if left or not (stored and stored.get("complete")):
                todo.append((spec, kwargs, c, left))
    return todo


def check_given_options(args: argparse.Namespace, model: Any) -> None:
    """A loaded model runs as it is, in the transformers engine: the options that say how a model given by name is
    loaded (dtype, device, device_map) are refused where they ask for something else than the model is, rather than
    ignored; `args.dtype` becomes the model's own, which the results file records."""
    if args.engine != engines.DEFAULT:
        raise ValueError(f"a loaded model runs in the transformers engine; --engine {args.engine} loads its own model "
                         "by name: give the model's name or path instead")
    target = unwrap(model)
    have = dtype_name(target.dtype)
    if args.dtype not in (None, "auto", have):
        raise ValueError(f"dtype={args.dtype!r} is how a model given by name is loaded; this loaded model is "
                         f"{target.dtype} (dtype={have!r}) and runs as it is: leave dtype out, or cast the model first "
                         f"(model.to(torch.{DTYPES[args.dtype]}))")
    args.dtype = have
    if args.device_map is not None:
        raise ValueError(f"device_map={args.device_map!r} is how a model given by name is placed as it loads; a loaded "
                         "model runs where it is: leave device_map out (or load it with device_map=... yourself)")
    if args.device is not None and not _on_device(target, args.device):
        where = sorted({str(p.device) for p in target.parameters()})
        raise ValueError(f"device={args.device!r} is where a model given by name is loaded; this loaded model is on "
                         f"{', '.join(where)}: leave device out, or move the model first (model.to({args.device!r}))")


def _on_device(model: Any, device: str) -> bool:
    """Whether every parameter of `model` is on `device` ("cuda" matches any CUDA device, "cuda:1" only that one)."""
    try:
        want = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device={device!r}: {e}") from None
    return all(p.device.type == want.type and want.index in (None, p.device.index) for p in model.parameters())


def check_engine_options(args: argparse.Namespace, engine: type[engines.Engine]) -> None:
    """Refuse the model options `engine` (a class of engines.ENGINES) would ignore; then fill in the defaults."""
    ignored = [f"--{k.replace('_', '-')}" for k in MODEL_OPTIONS
               if getattr(args, k) is not None and k not in engine.reads]
    if ignored:
        raise ValueError(f"--engine {engine.name} does not read {' or '.join(ignored)}: {engine.unread_reason}; "
                         "leave them out")
    check_device(args.device)
    for k, default in MODEL_OPTIONS.items():
        if getattr(args, k) is None:
            setattr(args, k, default)


def _run(ev: Swept, run: Run, todo: list, results: Results) -> None:
    bar = tqdm(total=sum(u.tokens for *_, left in todo for u in left), unit="tok", unit_scale=True, desc=ev.name,
               file=sys.stderr, dynamic_ncols=True)
    try:
        for spec, entries in itertools.groupby(todo, key=lambda item: item[0]):
            group = list(entries)
            with run.applied(run.model, group[0][1], spec):  # patch once per spec, not per cell
                for _, kwargs, c, left in group:
                    bar.set_postfix_str(" ".join([spec] + [_label(k, v) for k, v in c.key.items()]))
                    cell = results.cell({"patch": spec, **c.key},  # cell() calls the maker at once, if at all:
                                        lambda: {"patch": spec, **c.key, **c.fields,  # noqa: B023 - see above
                                                 "patch_kwargs": kwargs,  # noqa: B023 - see above
                                                 ev.records: [], "complete": False})
                    for unit in left:
                        done = [0]
                        paths_before = run.paths_ran(run.model)

                        def progress(n, done=done) -> None:
                            done[0] += n
                            bar.update(n)

                        t0 = time.perf_counter()
                        record = {ev.unit_key: unit.id, **ev.run_unit(run, cell, unit, progress)}
                        record["seconds"] = round(time.perf_counter() - t0, 3)
                        cell["complete"] = False
                        cell[ev.records].append(record)
                        # saved with the unit's record, so that a run interrupted later keeps them counted
                        _add_paths_since(cell, paths_before, run.paths_ran(run.model))
                        results.save()
                        bar.update(unit.tokens - done[0])
                    results.finish(cell)
                    results.save()
    finally:
        bar.close()


def _add_paths_since(cell: dict, before: dict, now: dict) -> None:
    """The cell records the attention paths its units ran (added to what an earlier, resumed run recorded)."""
    total = dict(cell.get("attention_path", {}))
    for path, calls in now.items():
        if calls > before.get(path, 0):
            total[path] = total.get(path, 0) + calls - before.get(path, 0)
    if total:
        cell["attention_path"] = total


def _label(key: str, value: Any) -> str:
    return length_label(value) if key == "length" else f"{key} {value}" if isinstance(value, float) else str(value)
