"""The resumable search: generation after generation of candidates, each scored on the calibration samples and
written to OUT/results.json (evaluate/results.py: locked, rewritten atomically after every sample, continued only
by a search with the same identity).

Generation 0 is the unpatched model (the reference of the short-context guard) and every family's starting
points. Generation g >= 1 is drawn from a generator seeded by (seed, g) from the best candidates of everything
scored before it, so a resumed search draws exactly the candidates the interrupted one would have: a kill loses at
most the sample in flight, and the same command finishes the same search. The budget (candidates scored, wall
time of this run) is checked before each candidate: a candidate is started only if it is expected to end in time.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from ..adapters.positions import trained_window
from ..apply import unwrap
from ..evaluate.common import applied, length_label, live_spec, versions
from ..evaluate.report import figure, markdown_table, number
from ..evaluate.results import Results, now
from ..lm import budget as costs
from ..lm import text as texts
from ..lm.causal import causal_lm_parts
from ..lm.text import Document, tokenizer_fingerprint
from ..utils.files import describe_os_error
from . import objective, space

if TYPE_CHECKING:
    from transformers import PreTrainedModel

RESULTS = "results.json"
BEST = "best.json"
KIND = "search"


@dataclass
class Options:
    """What the user chose (every field but the budget decides which candidates are drawn: the identity)."""

    target: int
    window: int | None = None  # the trained window (default: the model's config)
    seed: int = 0
    population: int = 8  # candidates per generation after the first
    parents: int = 4  # the best candidates new ones are drawn from
    samples: int = 2  # calibration samples of `target` tokens
    span: int | None = None  # tokens of the repeated span (default: min(32, window / 4))
    needle_weight: float = 0.5
    guard: float = 0.01  # the largest relative rise of perplexity at the trained window
    families: list[str] = field(default_factory=lambda: list(space.FAMILIES))


@dataclass
class Budget:
    evaluations: int | None = None  # candidates scored in all (the results file's, the reference included)
    seconds: float | None = None  # wall time of this run

    def __post_init__(self):
        if self.evaluations is None and self.seconds is None:
            raise ValueError("the search needs a budget: a number of candidates, a wall time, or both (e.g. --budget "
                             "2h, --budget 200, --budget 30m,200)")


def parse_budget(text: str) -> Budget:
    """'2h' / '30m' / '90s' (wall time), '200' (candidates), or both joined by a comma ('2h,200')."""
    units = {"s": 1, "m": 60, "min": 60, "h": 3600}
    evaluations, seconds = None, None
    for raw in text.split(","):
        part = raw.strip().lower()
        unit = next((u for u in sorted(units, key=len, reverse=True) if part.endswith(u)), None)
        try:
            value = float(part[: -len(unit)] if unit else part)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value <= 0 or (unit is None and value != int(value)):
            raise ValueError(f"--budget {text!r}: {raw.strip()!r} is neither a wall time (2h, 30m, 90s) nor a number "
                             "of candidates (200); both may be given, joined by a comma")
        if unit:
            seconds = value * units[unit]
        else:
            evaluations = int(value)
    return Budget(evaluations, seconds)


def check_options(opts: Options) -> None:
    """ValueError naming the first option out of its range."""
    for name in ("population", "parents", "samples", "seed", *(["span"] if opts.span is not None else []),
                 *(["window"] if opts.window is not None else [])):
        value = getattr(opts, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "seed" else 1):
            raise ValueError(f"{name} must be a{' non-negative' if name == 'seed' else ' positive'} integer, "
                             f"got {value!r}")
    if not 0.0 <= opts.needle_weight <= 1.0:
        raise ValueError(f"needle_weight must be in [0, 1], got {opts.needle_weight}")
    if not 0.0 <= opts.guard < 10.0:
        raise ValueError(f"guard must be in [0, 10) (a relative rise: 0.01 is 1 %), got {opts.guard}")


def model_identity(model: PreTrainedModel) -> dict:
    """A live model by content: a SHA-256 over its parameters and buffers (names, dtypes, values), and the patch
    it carries."""
    h = hashlib.sha256()
    target = unwrap(model)
    for name, t in sorted([*target.state_dict().items()]):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return {"model_type": target.config.model_type, "state_sha256": h.hexdigest(), "patch": live_spec(model)}


# ---------------------------------------------------------------------------------------------------- the search


class Search:
    def __init__(self, model: PreTrainedModel, tok: Any, opts: Options, setting: space.Setting, families: list[str],
                 samples: list[objective.Sample], results: Results):
        self.model, self.tok, self.opts, self.setting = model, tok, opts, setting
        self.families, self.samples, self.results = families, samples, results
        self.parts = causal_lm_parts(model)

    # ------------------------------------------------------------------------------------------------ candidates

    def generation(self, g: int) -> list[tuple[str, dict]]:
        """The candidates of generation g, as (family, parameters)."""
        if g == 0:
            return [("none", {"from": "none"})] + [(f, p) for f in self.families
                                                   for p in space.FAMILIES[f].start(self.setting)]
        rng = random.Random(f"hfpatch-search:{self.opts.seed}:{g}")
        # drawn from the generations before g alone: a resumed search, which holds some of g's own scores already,
        # draws g again exactly as it was first drawn
        before = [c for c in self.results.data["cells"] if c["generation"] < g]
        ranked = [c for c in self.ranked(before) if c["family"] != "none" and c.get("score") is not None]
        parents = ranked[: self.opts.parents]
        if not parents:
            return []
        seen = {self._key(c["spec"]) for c in before}
        out: list[tuple[str, dict]] = []
        for _ in range(self.opts.population):
            family, params = self._child(rng, parents)
            for _ in range(10):  # a candidate already scored is drawn again
                if self._key(space.spec(family, params, self.setting)) not in seen:
                    break
                family, params = self._child(rng, parents)
            seen.add(self._key(space.spec(family, params, self.setting)))
            out.append((family, params))
        return out

    def _child(self, rng: random.Random, parents: list[dict]) -> tuple[str, dict]:
        a = rng.choice(parents)
        mates = [p for p in parents if p["family"] == a["family"] and p is not a]
        fam = space.FAMILIES[a["family"]]
        if mates and rng.random() < 0.3:
            child = fam.cross(rng, a["params"], rng.choice(mates)["params"], self.setting)
        else:
            child = fam.mutate(rng, a["params"], self.setting)
        why = fam.why_not(child, self.setting)
        if why:  # the operators keep the constraints; this would be a bug in one of them
            raise RuntimeError(f"search: a {a['family']} candidate breaks its constraints ({why}): {child}")
        return a["family"], child

    @staticmethod
    def _key(spec: dict) -> str:
        return json.dumps(spec, sort_keys=True)

    def baseline_short(self) -> float | None:
        ref = self.results.find({"patch": "g0c0"})
        return ref.get("short_ppl") if ref and ref.get("complete") else None

    def ranked(self, cells: list[dict] | None = None) -> list[dict]:
        """The scored candidates (of `cells`, default all), best first: feasible ones by score, then the others
        (ties: the earlier first)."""
        base = self.baseline_short()
        done = [c for c in (self.results.data["cells"] if cells is None else cells) if c.get("complete")]
        return sorted(done, key=lambda c: (not objective.feasible(c, base, self.opts.guard),
                                           math.inf if c.get("score") is None else c["score"], c["order"]))

    def best(self) -> dict | None:
        base = self.baseline_short()
        return next((c for c in self.ranked() if c["family"] != "none"
                     and objective.feasible(c, base, self.opts.guard)), None)

    # ------------------------------------------------------------------------------------------------ evaluation

    def evaluate(self, cell: dict) -> None:
        """Score the cell's candidate on every sample it has no record for; the file is saved after each."""
        try:
            with applied(self.model, cell["spec"], cell["patch"]):
                for k in range(len(cell["samples"]), len(self.samples)):
                    cell["samples"].append({"sample": k, **objective.score_sample(self.parts, self.samples[k],
                                                                                   self.setting.window)})
                    self.results.save()
        except (ValueError, TypeError) as e:  # a patch this model refuses: recorded, never chosen
            cell["error"] = " ".join(str(e).split())
            cell["samples"] = []
        self.results.finish(cell)
        self.results.save()

    def run(self, budget: Budget, per_candidate: float, progress: bool) -> str:
        """Score candidates until the budget is spent; returns why it stopped."""
        t0 = time.perf_counter()
        try:
            return self._run(budget, per_candidate, progress, t0)
        finally:
            self.results.data["runs"][-1]["seconds"] = round(time.perf_counter() - t0, 2)

    def _run(self, budget: Budget, per_candidate: float, progress: bool, t0: float) -> str:
        took: list[float] = []
        cells = self.results.data["cells"]
        total = budget.evaluations
        if total is None and budget.seconds is not None:
            total = sum(c.get("complete", False) for c in cells) + int(budget.seconds // max(per_candidate, 1e-9))
        bar = tqdm(total=total, initial=sum(bool(c.get("complete")) for c in cells), unit="candidate",
                   disable=not progress, file=sys.stderr, dynamic_ncols=True)
        try:
            g = 0
            while True:
                candidates = self.generation(g)
                if not candidates:
                    return "no scored candidate to draw new ones from"
                for i, (family, params) in enumerate(candidates):
                    name = f"g{g}c{i}"
                    spec = {} if family == "none" else space.spec(family, params, self.setting)
                    cell = self.results.find({"patch": name})
                    if cell is not None and (cell["family"], cell["spec"]) != (family, spec):
                        raise ValueError(f"{self.results.path}: candidate {name} there is {cell['family']} "
                                         f"{cell['spec']}, this search draws {family} {spec}: the file was written by "
                                         "another version of hfpatch; use another --out, or --overwrite")
                    if cell is not None and cell.get("complete"):
                        continue
                    done = sum(bool(c.get("complete")) for c in cells)
                    if budget.evaluations is not None and done >= budget.evaluations:
                        return f"{budget.evaluations} candidates scored"
                    expected = sum(took) / len(took) if took else per_candidate
                    if budget.seconds is not None and time.perf_counter() - t0 + expected > budget.seconds:
                        return f"the wall-time budget ({costs.duration(budget.seconds)}) would be passed"
                    if cell is None:
                        cell = self.results.cell({"patch": name}, lambda: {
                            "patch": name, "generation": g, "family": family, "params": params,  # noqa: B023
                            "spec": spec, "order": len(cells), "samples": [], "complete": False})  # noqa: B023
                    start = time.perf_counter()
                    self.evaluate(cell)
                    took.append(time.perf_counter() - start)
                    cell["seconds"] = round(took[-1], 3)
                    self.results.save()
                    best = self.best()
                    bar.set_postfix_str(f"best {label(best) if best else '-'} "
                                        f"{number(best['score'], 4) if best else ''}".strip())
                    bar.update(1)
                g += 1
        finally:
            bar.close()


# ------------------------------------------------------------------------------------------------------- reports


def label(cell: dict) -> str:
    """A candidate in a few words: its family and the settings that tell it apart."""
    p, fam = cell["params"], cell["family"]
    if fam == "none":
        return "none"
    if fam == "longrope":
        f = p["factors"]
        text = f"longrope[{p['from']}] λ {f[0]:.3g}..{f[-1]:.3g} a={p['attention_factor']:.3g}"
    else:
        shown = {k: v for k, v in cell["spec"].items() if k not in ("position", "original_max_position_embeddings",
                                                                    "attention_temperature")}
        text = fam + " " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items())
    return text + (f" +{p['temperature']}" if p.get("temperature") else "")


def table(data: dict, guard: float) -> str:
    """The best candidate against every starting point (generation 0)."""
    cells = [c for c in data["cells"] if c.get("complete")]
    ref = next((c for c in cells if c["patch"] == "g0c0"), None)
    base = ref.get("short_ppl") if ref else None
    best_name = data.get("best")
    rows = []
    chosen = [c for c in cells if c["patch"] == best_name] + [c for c in cells if c["generation"] == 0]
    for c in chosen:
        rise = (f"{100 * (c['short_ppl'] / base - 1):+.2f} %" if base and c.get("short_ppl") is not None else "")
        ok = "error: " + c["error"][:60] if c.get("error") else (
            "yes" if objective.feasible(c, base, guard) else "no (guard)")
        rows.append([("**best** " if c["patch"] == best_name else "") + c["patch"], label(c),
                     number(c.get("needle_ppl")), number(c.get("plain_ppl")), number(c.get("short_ppl")), rise,
                     number(c.get("score"), 4), ok])
    return markdown_table(["candidate", "patch", "needle ppl", "plain ppl", "ppl at window", "vs none", "score",
                           "feasible"], rows)


def caption(data: dict) -> str:
    s = data["identity"]
    return (f"hfpatch search: {s['model'].get('model_type', 'the model')} at "
            f"{length_label(s['target'])} (trained window {length_label(s['window'])}), {s['samples']} calibration "
            f"sample(s), {sum(bool(c.get('complete')) for c in data['cells'])} candidates scored; score = "
            f"{s['needle_weight']:g} x needle NLL + {1 - s['needle_weight']:g} x plain NLL, guard "
            f"{100 * s['guard']:g} % at the window")


def plot(data: dict, path: Path, guard: float) -> None:
    """Every candidate's score in the order scored, and the best feasible score so far."""
    cells = sorted([c for c in data["cells"] if c.get("complete") and c.get("score") is not None],
                   key=lambda c: c["order"])
    ref = next((c for c in cells if c["patch"] == "g0c0"), None)
    base = ref.get("short_ppl") if ref else None
    fig = figure(figsize=(7, 4))
    ax = fig.add_subplot()
    ok = [objective.feasible(c, base, guard) for c in cells]
    ax.scatter([c["order"] for c, f in zip(cells, ok) if f], [c["score"] for c, f in zip(cells, ok) if f],
               s=12, label="candidate", color="C0")
    ax.scatter([c["order"] for c, f in zip(cells, ok) if not f], [c["score"] for c, f in zip(cells, ok) if not f],
               s=12, marker="x", label="outside the guard", color="C3")
    xs, ys, best = [], [], math.inf
    for c, f in zip(cells, ok):
        if f and c["family"] != "none":
            best = min(best, c["score"])
        if math.isfinite(best):
            xs.append(c["order"])
            ys.append(best)
    ax.step(xs, ys, where="post", label="best so far", color="C1")
    if ref is not None:
        ax.axhline(ref["score"], color="grey", linestyle=":", label="unpatched")
    ax.set_xlabel("candidate")
    ax.set_ylabel("score (nats)")
    ax.set_title(caption(data), fontsize=7, wrap=True)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _write_text(path: Path, text: str) -> None:
    """Write a file whole: a temporary file renamed over it (a kill leaves the previous one)."""
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise ValueError(f"cannot write {path} ({describe_os_error(e)})") from None
        raise


# ------------------------------------------------------------------------------------------------------ the API


def search(model: PreTrainedModel, tokenizer: Any, target_length: int, *, out: Path | str, budget: Budget | str,
           text_files: list | None = None,
           documents: list[Document] | None = None, seed: int = 0, population: int = 8, parents: int = 4,
           samples: int = 2, span: int | None = None, needle_weight: float = 0.5, guard: float = 0.01,
           families: list[str] | str | None = None, window: int | None = None, overwrite: bool = False,
           progress: bool = True, make_plot: bool = True, memory_check: bool = True,
           identity: dict | None = None) -> dict:
    """Search the patch that minimises the objective (objective.py) at `target_length` for this model, scoring
    candidates into OUT/results.json until the budget is spent; write OUT/best.json, OUT/table.md and
    OUT/convergence.png. `identity` names the model by content (default: a hash of its weights). Returns {"best":
    candidate name, "spec": the patch's keyword arguments, "score", "label", "results": path} (best and spec None
    when no candidate kept the guard)."""
    if isinstance(families, str):
        families = space.parse_families(families)
    opts = Options(target=target_length, window=window, seed=seed, population=population, parents=parents,
                   samples=samples, span=span, needle_weight=needle_weight, guard=guard,
                   families=list(families) if families is not None else list(space.FAMILIES))
    check_options(opts)
    budget = parse_budget(budget) if isinstance(budget, str) else budget
    window = _fill_window(model, opts)
    opts.span = opts.span or max(2, min(32, window // 4))
    setting, families, left_out = _applicable_families(model, opts, window)
    docs = documents if documents is not None else (texts.text_files(text_files) if text_files
                                                    else texts.default_corpus())
    calibration = objective.build(tokenizer, docs, target_length, window, opts.samples, opts.span, opts.seed)
    ident = {"model": identity or model_identity(model), "tokenizer": tokenizer_fingerprint(tokenizer),
             "text_sha256": hashlib.sha256("\0".join(d.sha256 for d in docs).encode()).hexdigest(),
             "target": target_length, "window": window, "seed": opts.seed, "population": opts.population,
             "parents": opts.parents, "samples": opts.samples, "span": opts.span,
             "needle_weight": opts.needle_weight, "guard": opts.guard, "families": families,
             "dtype": str(next(unwrap(model).parameters()).dtype)}
    out = Path(out)
    results = Results(out / RESULTS, KIND, ident, "samples",
                      lambda r: objective.summarize(r, opts.needle_weight), overwrite)
    try:
        if results.resumed:
            print(f"hfpatch search: resuming from {out / RESULTS}", file=sys.stderr)
        per_candidate = _estimate(model, opts, memory_check)
        results.data.update(versions=versions(), settings={"families_left_out": left_out})
        results.data.setdefault("runs", []).append({"started": now(), "estimate_per_candidate_s":
                                                    round(per_candidate, 2), "budget": vars(budget)})
        results.save()
        s = Search(model, tokenizer, opts, setting, families, calibration, results)
        stopped = s.run(budget, per_candidate, progress)
        best = s.best()
        results.data["best"] = best["patch"] if best else None
        results.data["runs"][-1].update(finished=now(), stopped=stopped)
        results.save()
        print(f"hfpatch search: stopped: {stopped}", file=sys.stderr)
        return _outputs(results.data, out, best, opts, make_plot)
    finally:
        results.close()


def _fill_window(model: PreTrainedModel, opts: Options) -> int:
    """Fill in opts.window (the model's trained window unless given), refusing a target that the window already
    covers; the window."""
    window = opts.window or trained_window(unwrap(model).config)
    if window is None:
        raise ValueError("the model's config names no trained window (max_position_embeddings): pass window=")
    opts.window = window
    if opts.target <= window:
        raise ValueError(f"the target length ({opts.target}) must be longer than the trained window ({window}): "
                         "within it the model needs no extension")
    return window


def _applicable_families(model: PreTrainedModel, opts: Options,
                         window: int) -> tuple[space.Setting, list[str], dict[str, str]]:
    """(the search space's setting for this model, the families of opts that apply to it, {family left out: why}),
    each one left out said on stderr; no family that applies is an error."""
    opts.families = space.parse_families(",".join(opts.families))
    setting, left_out = space.setting_for(model, window, opts.target, opts.families)
    families = [f for f in opts.families if f not in left_out]
    for name, why in left_out.items():
        print(f"hfpatch search: leaving out {name}: {' '.join(why.split())}", file=sys.stderr)
    if not families:
        raise ValueError("no family of the search space applies to this model: " + "; ".join(left_out.values()))
    return setting, families, left_out


def _estimate(model: PreTrainedModel, opts: Options, memory_check: bool) -> float:
    """Refuse a target length whose forward cannot fit in the memory that is free; the expected seconds per
    candidate (printed), from one timed forward."""
    target = unwrap(model)
    shape = costs.shape_of_config(target.config)
    parts = causal_lm_parts(model)
    weight_bytes = next(target.parameters()).element_size()
    need = costs.memory_needed(shape, weight_bytes, opts.target, score_chunk=1024)
    device = parts.input_device
    free, where = costs.available_memory(str(device), None)
    if memory_check and free is not None and need["total"] - need["weights"] > free:
        raise ValueError(f"reading {opts.target} tokens needs about {costs.gb(need['total'] - need['weights'])} "
                         f"beyond the weights and {where} has {costs.gb(free)} free: use a shorter target length, "
                         "or pass no_memory_check / --no-memory-check")
    speed = costs.measure_speed(parts, shape, min(opts.target, 2048))
    window = opts.window or opts.target
    per = opts.samples * (speed.seconds(shape, opts.target, head_positions=opts.target)
                          + speed.seconds(shape, window, head_positions=window))
    print(f"hfpatch search: about {costs.duration(per)} per candidate ({opts.samples} sample(s) of "
          f"{length_label(opts.target)} tokens, plus {length_label(window)} for the guard); memory about "
          f"{costs.gb(need['total'])}", file=sys.stderr)
    return per


def _outputs(data: dict, out: Path, best: dict | None, opts: Options, make_plot: bool) -> dict:
    """best.json (the best candidate's patch, as hfpatch.patch's keyword arguments), table.md, the plot."""
    text = caption(data) + "\n\n" + table(data, opts.guard)
    _write_text(out / "table.md", text + "\n")
    print(text)
    if make_plot:
        plot(data, out / "convergence.png", opts.guard)
    if best is None:
        (out / BEST).unlink(missing_ok=True)
        scored = any(c.get("complete") and c["family"] != "none" for c in data["cells"])
        why = ("no candidate kept perplexity at the trained window within the guard" if scored
               else "no patch was scored yet (a larger budget continues the search)")
        print(f"hfpatch search: {why}; no best.json", file=sys.stderr)
        return {"best": None, "spec": None, "results": str(out / RESULTS)}
    _write_text(out / BEST, json.dumps(best["spec"], indent=1) + "\n")
    print(f"hfpatch search: best {label(best)} (score {best['score']:.4f}): {out / BEST}", file=sys.stderr)
    return {"best": best["patch"], "spec": best["spec"], "score": best["score"], "label": label(best),
            "results": str(out / RESULTS)}
