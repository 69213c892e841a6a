"""The search from Python: `search()` (hfpatch.search.search) and `prepare()`: the options checked, the model's
setting and families, the calibration samples, the results file, then the loop (loop.py) and the outputs
(OUT/best.json, OUT/table.md, OUT/convergence.png)."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..adapters.positions import trained_window
from ..apply import unwrap
from ..evaluate.common import live_spec, versions
from ..evaluate.results import Results, now
from ..lm import budget as costs
from ..lm import text as texts
from ..lm.causal import causal_lm_parts
from ..lm.text import Document, tokenizer_fingerprint
from ..position.registry import MAX_FACTOR
from ..utils.files import write_text
from ..utils.modes import evaluating
from ..utils.timing import duration
from . import objective, report, space
from .loop import BEST, KIND, RESULTS, Plan, Search
from .options import SearchOptions
from .report import label

if TYPE_CHECKING:
    from transformers import PreTrainedModel



def model_identity(model: PreTrainedModel) -> dict:
    """A live model by content: a SHA-256 over its parameters and buffers (names, dtypes, values), and the patch
    it carries."""
    h = hashlib.sha256()
    target = unwrap(model)
    for name, t in sorted([*target.state_dict().items()]):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return {"model_type": target.config.model_type, "state_sha256": h.hexdigest(), "patch": live_spec(model)}


def search(model: PreTrainedModel, tokenizer: Any, options: SearchOptions | int | None = None, /, *,
           documents: list[Document] | None = None, identity: dict | None = None, started: float | None = None,
           **settings: Any) -> dict:
    """Search the patch that minimises the objective (objective.py) at the target length for this model, scoring
    candidates into OUT/results.json until the budget is spent; write OUT/best.json, OUT/table.md and
    OUT/convergence.png.

    `options`: a SearchOptions, or the target length with the other options as keywords (`out`, `budget`, `seed`,
    ...: hfpatch.search.options, the same as the command's flags). `documents` gives the calibration text as
    documents instead of `text_files`; `identity` names the model by content (default: a hash of its weights);
    `started`, a time.perf_counter() value, is when the wall-time budget began (default: this call).
    The model is scored in eval mode and left in the mode it was in. Returns {"best": candidate name, "spec": the
    patch's keyword arguments, "score", "label", "results": path}; "best" is None and "spec" {} (the model as it
    is) when no patch beats the unpatched model."""
    started = time.perf_counter() if started is None else started
    opts = _options(options, settings)
    budget = opts.the_budget
    s = prepare(model, tokenizer, opts, documents, identity)
    results, out = s.results, Path(opts.out)
    try:
        results.data.setdefault("runs", []).append({"started": now(), "budget": str(budget)})
        with evaluating(model):
            s.clock.started = started
            s.measure()
            results.data["runs"][-1]["estimate"] = s.clock.estimate
            print(f"hfpatch search: {s.describe_costs()}", file=sys.stderr)
            s.check_budget(budget)
            try:
                stopped = s.run(budget, opts.progress)
            finally:
                results.data["runs"][-1].update(seconds=round(s.clock.elapsed(), 2), measured=s.measured())
                results.save()
        best, why = s.best()
        results.data["best"] = best["patch"] if best else None
        results.data["runs"][-1].update(finished=now(), stopped=stopped)
        results.save()
        print(f"hfpatch search: stopped: {stopped}", file=sys.stderr)
        _print_timing(s)
        return _outputs(results.data, out, best, why, opts.plot)
    finally:
        results.close()


def prepare(model: PreTrainedModel, tokenizer: Any, opts: SearchOptions, documents: list[Document] | None = None,
            identity: dict | None = None) -> Search:
    """A search ready to run: its setting, samples and results file (opened and locked: close it with
    `search.results.close()`). Everything is checked before the file is opened."""
    window = _window(model, opts)
    span = opts.span or max(2, min(32, window // 4))
    setting, families, left_out = _applicable_families(model, opts, window)
    docs = documents if documents is not None else (texts.text_files(opts.text_files) if opts.text_files
                                                    else texts.default_corpus())
    plan = _plan(tokenizer, docs, opts, window, span)
    ident = {**opts.identity(), "window": window, "span": span, "families": families,
             "proxy": opts.proxy_tokens if plan.proxy else 0,
             "model": identity or model_identity(model), "tokenizer": tokenizer_fingerprint(tokenizer),
             "text_sha256": hashlib.sha256("\0".join(d.sha256 for d in docs).encode()).hexdigest(),
             "dtype": str(next(unwrap(model).parameters()).dtype)}
    _check_memory(model, opts)
    out = Path(opts.out)
    results = Results(out / RESULTS, KIND, ident, "samples", lambda r: objective.summarize(r, opts.needle_weight),
                      opts.overwrite)
    if results.resumed:
        print(f"hfpatch search: resuming from {out / RESULTS}", file=sys.stderr)
    results.data.update(versions=versions(), settings={"families_left_out": left_out})
    return Search(model, tokenizer, opts, setting, families, plan, results)


def _options(options: SearchOptions | int | None, settings: dict) -> SearchOptions:
    if isinstance(options, SearchOptions):
        if settings:
            raise TypeError(f"search() takes its options as a SearchOptions or as keywords, not both (got "
                            f"{', '.join(sorted(settings))} besides a SearchOptions)")
        return options
    if options is not None:
        if "target_length" in settings:
            raise TypeError("search() got the target length twice (positionally and as target_length=)")
        settings = {**settings, "target_length": options}
    return SearchOptions.from_python(**settings)


def _window(model: PreTrainedModel, opts: SearchOptions) -> int:
    """The trained window (the model's unless given), refusing a target that the window already covers."""
    window = opts.window or trained_window(unwrap(model).config)
    if window is None:
        raise ValueError("the model's config names no trained window (max_position_embeddings): pass window=")
    if opts.target_length > window * MAX_FACTOR:
        raise ValueError(f"the target length ({opts.target_length}) is more than {MAX_FACTOR:g} times the trained "
                         f"window ({window}), the largest extension the position schemes take")
    if opts.target_length <= window:
        raise ValueError(f"the target length ({opts.target_length}) must be longer than the trained window "
                         f"({window}): within it the model needs no extension")
    return window


def _plan(tok: Any, docs: list[Document], opts: SearchOptions, window: int, span: int) -> Plan:
    """The samples, the proxy samples (when they fit; said on stderr when they do not) and the guard's text."""
    text = objective.calibration_ids(tok, docs)
    proxied = opts.proxy_samples if opts.proxy_tokens else 0
    why = objective.proxy_misfit(tok, opts.target_length, opts.proxy_tokens, opts.proxy_segments,
                                 span) if proxied else None
    if why:
        print(f"hfpatch search: no proxy stage ({why}): every candidate is scored at full length", file=sys.stderr)
        proxied = 0
    full = objective.build(tok, text, opts.target_length, window, max(opts.samples, proxied), span, opts.seed)
    proxy = objective.build_proxy(tok, full[:proxied], opts.proxy_tokens, opts.proxy_segments, span) if proxied \
        else None
    return Plan(window, full[:opts.samples], proxy, objective.guard_ids(tok, text, window))


def _applicable_families(model: PreTrainedModel, opts: SearchOptions,
                         window: int) -> tuple[space.Setting, list[str], dict[str, str]]:
    """(the search space's setting for this model, the families of opts that apply to it, {family left out: why}),
    each one left out said on stderr; no family that applies is an error."""
    names = opts.family_names
    setting, left_out = space.setting_for(model, window, opts.target_length, names)
    families = [f for f in names if f not in left_out]
    for name, why in left_out.items():
        print(f"hfpatch search: leaving out {name}: {' '.join(why.split())}", file=sys.stderr)
    if not families:
        raise ValueError("no family of the search space applies to this model: " + "; ".join(left_out.values()))
    return setting, families, left_out


def _check_memory(model: PreTrainedModel, opts: SearchOptions) -> None:
    """Refuse a target length whose forward cannot fit in the memory that is free."""
    if not opts.memory_check:
        return
    target = unwrap(model)
    shape = costs.shape_of_config(target.config)
    need = costs.memory_needed(shape, next(target.parameters()).element_size(), opts.target_length, score_chunk=1024)
    free, where = costs.available_memory(str(causal_lm_parts(model).input_device), None)
    if free is not None and need["total"] - need["weights"] > free:
        raise ValueError(f"reading {opts.target_length} tokens needs about {costs.gb(need['total'] - need['weights'])} "
                         f"beyond the weights and {where} has {costs.gb(free)} free: use a shorter target length, "
                         "or pass memory_check=False / --no-memory-check")


def _print_timing(s: Search) -> None:
    """The estimate against what this run measured, per candidate."""
    m, e = s.measured(), s.clock.estimate
    parts = []
    if "rank" in m:
        first = f" ({duration(e['rank_first'])} from the first forwards)" if "rank_first" in e else ""
        parts.append(f"per ranked candidate estimated {duration(e['rank'])}{first}, measured {duration(m['rank'])} "
                     f"over {m['ranked_candidates']} ({m['guard_reads']} guard read(s))")
    if "full_sample" in m and s.plan.proxy is not None:
        parts.append(f"per full-length sample estimated {duration(e['full_sample'])}, measured "
                     f"{duration(m['full_sample'])} over {m['full_samples']}")
    parts.append(f"wall time {duration(s.clock.elapsed())}")
    print("hfpatch search: " + "; ".join(parts), file=sys.stderr)


def _outputs(data: dict, out: Path, best: dict | None, why: str | None, make_plot: bool) -> dict:
    """best.json (the best candidate's patch as hfpatch.patch's keyword arguments; {} when no patch beats the
    unpatched model), table.md and the plot."""
    text = report.caption(data) + "\n\n" + report.table(data)
    write_text(out / "table.md", text + "\n")
    print(text)
    if make_plot:
        report.plot(data, out / "convergence.png")
    if best is None:
        scored_none = why is not None and why.startswith("no patch beats")
        if scored_none:
            write_text(out / BEST, "{}\n")
        else:
            (out / BEST).unlink(missing_ok=True)
        print(f"hfpatch search: {why}; " + (f"{out / BEST} holds no patch ({{}}: the model as it is)" if scored_none
                                            else "no best.json"), file=sys.stderr)
        return {"best": None, "spec": {} if scored_none else None, "why": why, "results": str(out / RESULTS)}
    full = report.full_cell(data, best["patch"]) or best
    write_text(out / BEST, json.dumps(best["spec"], indent=1) + "\n")
    print(f"hfpatch search: best {label(best)} (score {full['score']:.4f}): {out / BEST}", file=sys.stderr)
    return {"best": best["patch"], "spec": best["spec"], "score": full["score"], "label": label(best),
            "results": str(out / RESULTS)}
