"""The resumable search: generation after generation of candidates ranked on the calibration samples, then the best
of them scored at full length, everything written to OUT/results.json (evaluate/results.py: locked, rewritten
atomically after every sample, continued only by a search with the same identity).

Two stages when proxy samples fit (objective.py): every candidate is ranked on short proxy samples whose position
ids span the target length, and the `finalists` best feasible ones, with the unpatched model, are scored on
samples of the full target length; the best of those is the answer. Without a proxy, every candidate is scored at
full length.

Generation 0 is the unpatched model (the reference of the short-context guard, and the score a patch must beat)
and every family's starting points. Generation g >= 1 is drawn from a generator seeded by (seed, g) from the best
candidates of everything ranked before it, so a resumed search draws exactly the candidates the interrupted one
would have: a kill loses at most the sample in flight, and the same command finishes the same search. The guard's
text is read once per short-context setting (space.Family.short): candidates that agree on it share the record.

Time: the unpatched model's first forwards (the guard's text, its first sample) are timed, and they are the
first estimate of what a candidate costs here (enough to refuse a budget that cannot score one). Families differ in
cost (an attention path runs more than one attention; a child of generation >= 1 almost always has a short-context
setting of its own, so it reads the guard itself), so once generation 0 is ranked the estimate is each family's
starting point as measured, guard read included, averaged over the families; from then on the candidates' own
measured times decide. With a proxy stage, the unpatched model is scored at full length first: the full-length
stage is reserved from what its samples took, times each finalist's family cost at the ranking stage (the median of
the family's ranked candidates, against the unpatched model). A candidate is started only if it, and the
full-length stage after it, are expected to end within the wall-time budget.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from ..evaluate.common import applied
from ..evaluate.parsing import length_label
from ..evaluate.results import Results
from ..lm.causal import causal_lm_parts
from ..utils.timing import duration
from . import objective, report, space
from .options import Budget, SearchOptions
from .report import FULL, REFERENCE, label

if TYPE_CHECKING:
    from transformers import PreTrainedModel

RESULTS = "results.json"
BEST = "best.json"
KIND = "search"


@dataclass
class Plan:
    """What every candidate is scored on."""

    window: int
    samples: list[objective.Sample]  # of the target length
    proxy: list[objective.Sample] | None  # the ranking stage's samples (None: every candidate at full length)
    guard: list[int]  # the guard's text

    @property
    def ranking(self) -> list[objective.Sample]:
        return self.proxy if self.proxy is not None else self.samples


@dataclass
class Clock:
    """Seconds measured in this run: the guard reads, the ranking candidates, the full-length samples; and what the
    unpatched model's first forwards said to expect."""

    started: float = field(default_factory=time.perf_counter)
    guard_reads: list[float] = field(default_factory=list)
    ranked: list[float] = field(default_factory=list)  # a ranked candidate each, its guard read included
    full_by_family: dict[str, list[float]] = field(default_factory=dict)  # full-length samples, per family
    estimate: dict = field(default_factory=dict)  # guard, rank sample, full sample, rank candidate, full candidate

    @property
    def full_samples(self) -> list[float]:
        """Every full-length sample's seconds, whatever its family."""
        return [t for times in self.full_by_family.values() for t in times]

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def expected(self, what: str, measured: list[float]) -> float:
        """What the next one is expected to take: the slowest of the last eight measured (families differ in cost:
        a budget is kept by the slow ones), else the estimate."""
        return max(measured[-8:]) if measured else self.estimate[what]


class Search:
    def __init__(self, model: PreTrainedModel, tok: Any, opts: SearchOptions, setting: space.Setting,
                 families: list[str], plan: Plan, results: Results) -> None:
        self.model, self.tok, self.opts, self.setting = model, tok, opts, setting
        self.families, self.plan, self.results = families, plan, results
        self.parts = causal_lm_parts(model)
        self.clock = Clock()

    @property
    def cells(self) -> list[dict]:
        return self.results.data["cells"]

    # ------------------------------------------------------------------------------------------------ candidates

    def generation(self, g: int) -> list[tuple[str, dict]]:
        """The candidates of generation g, as (family, parameters)."""
        if g == 0:
            return [("none", {"from": "none"})] + [(f, p) for f in self.families
                                                   for p in space.FAMILIES[f].start(self.setting)]
        rng = random.Random(f"hfpatch-search:{self.opts.seed}:{g}")
        # drawn from the generations before g alone: a resumed search, which holds some of g's own scores already,
        # draws g again exactly as it was first drawn
        before = [c for c in report.ranked_cells(self.results.data) if c["generation"] < g]
        ranked = [c for c in self.ranked(before) if c["family"] != "none" and c.get("score") is not None]
        parents = ranked[: self.opts.parents]
        if not parents:
            return []
        seen = {_key(c["spec"]) for c in before}
        out: list[tuple[str, dict]] = []
        for _ in range(self.opts.population):
            family, params = self._child(rng, parents)
            for _ in range(10):  # a candidate already scored is drawn again
                if _key(space.spec(family, params, self.setting)) not in seen:
                    break
                family, params = self._child(rng, parents)
            seen.add(_key(space.spec(family, params, self.setting)))
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

    def baseline_short(self) -> float | None:
        ref = self.results.find({"patch": REFERENCE})
        return ref.get("short_ppl") if ref and ref.get("complete") else None

    def ranked(self, cells: list[dict]) -> list[dict]:
        """The scored candidates of `cells`, best first: feasible ones by score, then the others (ties: the earlier
        first)."""
        base = self.baseline_short()
        done = [c for c in cells if c.get("complete")]
        return sorted(done, key=lambda c: (not objective.feasible(c, base, self.opts.guard),
                                           math.inf if c.get("score") is None else c["score"], c["order"]))

    def finalists(self) -> list[dict]:
        """The ranked candidates the full-length stage scores: the `finalists` best feasible ones, one per spec."""
        base = self.baseline_short()
        out: list[dict] = []
        for c in self.ranked(report.ranked_cells(self.results.data)):
            if (c["family"] != "none" and objective.feasible(c, base, self.opts.guard)
                    and all(_key(c["spec"]) != _key(f["spec"]) for f in out)):
                out.append(c)
        return out[: self.opts.finalists]

    def best(self) -> tuple[dict | None, str | None]:
        """(the ranked cell of the feasible candidate with the best full-length score, or None; why there is
        none)."""
        data = self.results.data
        base = self.baseline_short()
        patched = [c for c in report.ranked_cells(data) if c["family"] != "none" and c.get("complete")]
        feasible = [c for c in patched if objective.feasible(c, base, self.opts.guard)]
        scored = [(full, c) for c in feasible
                  if (full := report.full_cell(data, c["patch"])) is not None and full.get("score") is not None]
        if not scored:
            return None, ("no patch was scored yet (a larger budget continues the search)" if not patched else
                          "no candidate kept perplexity at the trained window within the guard" if not feasible else
                          "no patch was scored at full length yet (a larger budget continues the search)")
        full, cell = min(scored, key=lambda fc: (fc[0]["score"], fc[1]["order"]))
        reference = report.full_cell(data, REFERENCE)
        if reference is not None and reference.get("score") is not None and full["score"] >= reference["score"]:
            return None, (f"no patch beats the unpatched model (the best, {cell['patch']} {label(cell)}, scores "
                          f"{full['score']:.4f} against {reference['score']:.4f})")
        return cell, None

    # ------------------------------------------------------------------------------------------------ evaluation

    def _guard_record(self, cell: dict) -> dict | None:
        """The guard record of an earlier cell with the same short-context setting, if any."""
        key = _guard_key(cell)
        for other in self.cells:
            if other is cell or other.get("error"):
                continue
            record = next((r for r in other["samples"] if "short_nll" in r), None)
            if record is not None and _guard_key(other) == key:  # "guard": read here; "from": whose read it is
                return {k: v for k, v in record.items() if k != "guard"} | {"from": record.get("from", other["patch"])}
        return None

    def evaluate(self, cell: dict, samples: list[objective.Sample], timings: list[float]) -> None:
        """Score the cell's candidate: its guard record (shared, or read), then every sample it has no record for;
        the file is saved after each. Each sample's seconds go to `timings`."""
        try:
            with applied(self.model, cell["spec"], cell["patch"]):
                if not any("short_nll" in r for r in cell["samples"]):
                    shared = self._guard_record(cell)
                    start = time.perf_counter()
                    record = shared or {"guard": True, **objective.score_guard(self.parts, self.plan.guard)}
                    if shared is None:
                        self.clock.guard_reads.append(time.perf_counter() - start)
                    cell["samples"].append(record)
                    self.results.save()
                done = {r["sample"] for r in cell["samples"] if "sample" in r}
                for k, sample in enumerate(samples):
                    if k in done:
                        continue
                    start = time.perf_counter()
                    cell["samples"].append({"sample": k, **objective.score_sample(self.parts, sample)})
                    timings.append(time.perf_counter() - start)
                    self.results.save()
        except (ValueError, TypeError) as e:  # a patch this model refuses: recorded, never chosen
            cell["error"] = " ".join(str(e).split())
            cell["samples"] = []
        self.results.finish(cell)
        self.results.save()

    def _existing(self, name: str, family: str, spec: dict) -> dict | None:
        """The results file's cell of candidate `name`, checked to be the candidate this search draws."""
        cell = self.results.find({"patch": name})
        if cell is not None and (cell["family"], cell["spec"]) != (family, spec):
            raise ValueError(f"{self.results.path}: candidate {name} there is {cell['family']} {cell['spec']}, this "
                             f"search draws {family} {spec}: the file was written by another version of hfpatch; use "
                             "another --out, or --overwrite")
        return cell

    def _cell(self, name: str, g: int, family: str, params: dict, spec: dict) -> dict:
        """The cell of candidate `name`, created if absent."""
        return self._existing(name, family, spec) or self.results.cell({"patch": name}, lambda: {
            "patch": name, "generation": g, "family": family, "params": params, "spec": spec,
            "order": len(self.cells), "samples": [], "complete": False})

    # ------------------------------------------------------------------------------------------------ the budget

    def measure(self) -> None:
        """The estimate of what each part of a candidate costs here: from the timings a run of this search stored,
        else from the unpatched model's guard read and first ranking sample, timed (and kept as its records)."""
        stored = [r["estimate"] for r in self.results.data.get("runs", [])[:-1] if r.get("estimate")]
        if stored:
            self.clock.estimate = stored[-1]
            return
        ref = self._cell(REFERENCE, 0, "none", {"from": "none"}, {})
        device = self.parts.input_device
        with torch.no_grad():  # first-call allocations and kernel selection, before anything is timed
            self.parts.base(input_ids=torch.tensor([self.plan.guard[:16]], device=device), use_cache=False)
        start = time.perf_counter()
        guard = {"guard": True, **objective.score_guard(self.parts, self.plan.guard)}
        guard_s = time.perf_counter() - start
        start = time.perf_counter()
        first = {"sample": 0, **objective.score_sample(self.parts, self.plan.ranking[0])}
        sample_s = time.perf_counter() - start
        if not ref["samples"]:  # the reference's own first records
            ref["samples"] += [guard, first]
            self.results.save()
        self.clock.estimate = self._estimate(guard_s, sample_s)

    def _estimate(self, guard: float, rank_sample: float) -> dict:
        """Seconds of a guard read, a ranking sample, a full-length sample, a ranked candidate and a finalist, from
        the two timed forwards (a full-length sample from a fit t(L) = a L + b L^2 through the guard's and the
        proxy sample's lengths when it was not read itself)."""
        window, target = len(self.plan.guard), self.opts.target_length
        if self.plan.proxy is None:
            full_sample = rank_sample
        else:
            p = len(self.plan.proxy[0].ids)
            b = max(0.0, (guard / window - rank_sample / p) / (window - p)) if window != p else 0.0
            a = max(rank_sample / p - b * p, 0.0)
            full_sample = a * target + b * target * target
        share = _guard_share(self.generation(0), self.setting)
        return {"guard": guard, "rank_sample": rank_sample, "full_sample": full_sample, "guard_share": share,
                "rank": len(self.plan.ranking) * rank_sample + share * guard,
                "full": len(self.plan.samples) * full_sample}

    def refine_estimate(self) -> None:
        """The per-candidate estimate from generation 0 as measured (stored seconds, so a resumed search agrees):
        per family, the mean time of its starting points that read the guard themselves; their mean over the
        families is the estimate of a ranked candidate."""
        per_family: dict[str, list[float]] = {}
        for cell in self.cells:
            if cell["generation"] != 0 or cell["family"] == "none" or "seconds" not in cell:
                continue
            if any(r.get("guard") for r in cell["samples"]):
                per_family.setdefault(cell["family"], []).append(cell["seconds"])
        if not per_family:
            return
        means = {f: sum(v) / len(v) for f, v in per_family.items()}
        self.clock.estimate = {**self.clock.estimate, "rank_first": self.clock.estimate.get("rank_first", self.clock
                               .estimate["rank"]), "rank": sum(means.values()) / len(means), "rank_by_family": means,
                               "guard_share": 1.0}
        self.results.data["runs"][-1]["estimate"] = self.clock.estimate
        print(f"hfpatch search: {self.describe_family_costs()}", file=sys.stderr)

    def describe_family_costs(self) -> str:
        e = self.clock.estimate
        each = ", ".join(f"{f} {duration(t)}" for f, t in e["rank_by_family"].items())
        return (f"the starting points measured about {duration(e['rank'])} per candidate, guard read included "
                f"({each}): the estimate from here on")

    def ranking_costs(self) -> dict[str, float]:
        """Per family, what a ranked candidate takes here: its ranked candidates' median, else its starting
        points' mean (the estimate), else nothing yet."""
        return ranked_seconds_by_family(self.cells) or self.clock.estimate.get("rank_by_family", {})

    def full_sample_seconds(self, family: str | None, costs: dict[str, float]) -> float:
        """What one full-length sample of a `family` candidate is expected to take: the slowest of this family's
        measured here, else the unpatched model's (measured first, before any candidate is ranked) times the
        family's cost at the ranking stage (`costs`: ranking_costs()), else the estimate."""
        measured = self.clock.full_by_family.get(family or "")
        if measured:
            return max(measured[-8:])
        base = self.clock.estimate.get("full_sample_reference", self.clock.estimate["full_sample"])
        return base * family_cost(self.clock.estimate, len(self.plan.ranking), family, costs)

    def full_reserve(self) -> float:
        """Seconds the full-length stage still needs: the samples each of its cells has left (the reference, the
        finalists chosen so far, and the places still open, costed as the costliest family)."""
        if self.plan.proxy is None:
            return 0.0
        chosen: list[tuple[str | None, str | None]] = [(REFERENCE, "none")]
        chosen += [(c["patch"], c["family"]) for c in self.finalists()]
        chosen += [(None, None)] * max(0, self.opts.finalists - (len(chosen) - 1))
        costs, total = self.ranking_costs(), 0.0
        for name, family in chosen:
            cell = self.results.find({"patch": name + FULL}) if name is not None else None
            done = sum("sample" in r for r in cell["samples"]) if cell is not None else 0
            total += (len(self.plan.samples) - done) * self.full_sample_seconds(family, costs)
        return total

    def _fits(self, budget: Budget, cost: float) -> bool:
        return budget.seconds is None or self.clock.elapsed() + cost <= budget.seconds

    def check_budget(self, budget: Budget) -> None:
        """Refuse a fresh search whose wall-time budget cannot score one candidate (and the full-length stage
        after it): one line, with the budget it needs."""
        if budget.seconds is None or any(c.get("complete") for c in self.cells):
            return
        e = self.clock.estimate
        ref_left = e["rank"] - e["rank_sample"] - e["guard_share"] * e["guard"]
        need = self.clock.elapsed() + ref_left + e["rank"] + (2 * e["full"] if self.plan.proxy is not None else 0)
        if need > budget.seconds:
            both = " (and both at full length)" if self.plan.proxy else ""
            raise ValueError(f"--budget {duration(budget.seconds)} cannot score one candidate here: the "
                             f"unpatched reference and one candidate{both} need about {duration(need)} on this "
                             f"machine ({self.describe_costs()}); give --budget {math.ceil(need / 60)}m or more")

    def describe_costs(self) -> str:
        e = self.clock.estimate
        target = length_label(self.opts.target_length)
        what = (f"{len(self.plan.ranking)} proxy sample(s) of {len(self.plan.proxy[0].ids)} tokens"
                if self.plan.proxy else f"{len(self.plan.samples)} sample(s) of {target}")
        text = (f"about {duration(e['rank'])} per candidate ({what} at {duration(e['rank_sample'])} each, "
                f"a guard read of {length_label(len(self.plan.guard))} tokens at {duration(e['guard'])} for "
                f"{100 * e['guard_share']:.0f} % of them)")
        if self.plan.proxy is not None:
            text += (f"; about {duration(e['full'])} per finalist at full length ({len(self.plan.samples)} "
                     f"sample(s) of {target})")
        return text

    # ------------------------------------------------------------------------------------------------ the stages

    def run(self, budget: Budget, progress: bool) -> str:
        """Rank candidates, then score the finalists at full length, until the budget is spent; returns why it
        stopped."""
        done = sum(bool(c.get("complete")) for c in report.ranked_cells(self.results.data))
        total = budget.evaluations
        if total is None and budget.seconds is not None:
            total = done + int(budget.seconds // max(self.clock.estimate["rank"], 1e-9))
        bar = tqdm(total=total, initial=done, unit="candidate", disable=not progress, file=sys.stderr,
                   dynamic_ncols=True)
        try:
            if self.plan.proxy is not None:
                early = self._reference_at_full_length(budget)
                if early:
                    return early
            stopped = self._rank(budget, bar)
            if self.plan.proxy is not None:
                stopped = self._finals(budget) or stopped
            return stopped
        finally:
            bar.close()

    def _rank(self, budget: Budget, bar: Any) -> str:
        g = 0
        while True:
            candidates = self.generation(g)
            if not candidates:
                return "no scored candidate to draw new ones from"
            for i, (family, params) in enumerate(candidates):
                name = f"g{g}c{i}"
                spec = {} if family == "none" else space.spec(family, params, self.setting)
                cell = self._existing(name, family, spec)
                if cell is not None and cell.get("complete"):
                    continue
                done = sum(bool(c.get("complete")) for c in report.ranked_cells(self.results.data))
                if budget.evaluations is not None and done >= budget.evaluations:
                    return f"{budget.evaluations} candidates ranked"
                if not self._fits(budget, self.clock.expected("rank", self.clock.ranked) + self.full_reserve()):
                    return f"the wall-time budget ({duration(budget.seconds or 0)}) would be passed"
                cell = cell or self._cell(name, g, family, params, spec)
                start = time.perf_counter()
                self.evaluate(cell, self.plan.ranking, [])
                self.clock.ranked.append(time.perf_counter() - start)
                cell["seconds"] = round(self.clock.ranked[-1], 3)
                self.results.save()
                leader = next(iter(self.finalists()), None)
                bar.set_postfix_str(f"best {label(leader)} {leader['score']:.4f}" if leader else "best -")
                bar.update(1)
            if g == 0:
                self.refine_estimate()
                if budget.evaluations is None and budget.seconds is not None:
                    bar.total = bar.n + int(max(0.0, budget.seconds - self.clock.elapsed())
                                            // max(self.clock.estimate["rank"], 1e-9))
            g += 1

    def _reference_at_full_length(self, budget: Budget) -> str | None:
        """The unpatched model at full length, before any candidate is ranked: what its samples take, measured,
        is what the full-length stage is reserved from (kept in the estimate, so a resumed search agrees)."""
        reference = self.results.find({"patch": REFERENCE})
        if reference is None or self.full_cell_of(reference).get("complete"):
            return None
        stopped = self._score_at_full_length(budget, reference)
        timings = self.clock.full_by_family.get("none")
        if stopped is None and timings:
            measured = sum(timings) / len(timings)
            self.clock.estimate = {**self.clock.estimate, "full_sample_reference": measured}
            self.results.data["runs"][-1]["estimate"] = self.clock.estimate
            self.results.save()
            print(f"hfpatch search: the unpatched model's full-length sample measured {duration(measured)} (estimated "
                  f"{duration(self.clock.estimate['full_sample'])}): the full-length stage is reserved from it, "
                  "times each finalist's family cost", file=sys.stderr)
        return stopped

    def _finals(self, budget: Budget) -> str | None:
        """The reference and the finalists at full length; why it stopped early (None: it did not)."""
        for ranked in [self.results.find({"patch": REFERENCE}), *self.finalists()]:
            if ranked is not None and not ranked.get("error"):
                stopped = self._score_at_full_length(budget, ranked)
                if stopped:
                    return stopped
        return None

    def _score_at_full_length(self, budget: Budget, ranked: dict) -> str | None:
        """A ranked candidate's samples at full length, if the budget has room for them; why not, if it has not."""
        cell = self.full_cell_of(ranked)
        if cell.get("complete"):
            return None
        left = len(self.plan.samples) - sum("sample" in r for r in cell["samples"])
        if not self._fits(budget, left * self.full_sample_seconds(ranked["family"], self.ranking_costs())):
            return (f"the wall-time budget ({duration(budget.seconds or 0)}) would be passed before "
                    f"{ranked['patch']} is scored at full length")
        self.evaluate(cell, self.plan.samples, self.clock.full_by_family.setdefault(ranked["family"], []))
        return None

    def full_cell_of(self, ranked: dict) -> dict:
        """The full-length cell of a ranked candidate (proxy stage), created if absent."""
        return self._cell(ranked["patch"] + FULL, ranked["generation"], ranked["family"], ranked["params"],
                          ranked["spec"])

    def measured(self) -> dict:
        """What this run measured, next to the estimate (seconds)."""
        e, c = self.clock.estimate, self.clock
        out = {"estimate": e, "ranked_candidates": len(c.ranked), "guard_reads": len(c.guard_reads),
               "full_samples": len(c.full_samples)}
        if c.ranked:
            out["rank"] = sum(c.ranked) / len(c.ranked)
        if c.guard_reads:
            out["guard"] = sum(c.guard_reads) / len(c.guard_reads)
        if c.full_samples:
            out["full_sample"] = sum(c.full_samples) / len(c.full_samples)
            out["full_sample_by_family"] = {f: sum(t) / len(t) for f, t in c.full_by_family.items() if t}
        return out


def ranked_seconds_by_family(cells: list[dict]) -> dict[str, float]:
    """Per family, the median seconds of its ranked candidates that read the guard themselves, every generation (the
    stored seconds, so that a resumed search agrees; the median, so that one candidate slowed by something else
    running does not move it): what a candidate of the family costs here."""
    per_family: dict[str, list[float]] = {}
    for cell in cells:
        if cell["family"] != "none" and "seconds" in cell and any(r.get("guard") for r in cell["samples"]):
            per_family.setdefault(cell["family"], []).append(cell["seconds"])
    return {f: statistics.median(v) for f, v in per_family.items()}


def family_cost(estimate: dict, ranking_samples: int, family: str | None, by_family: dict[str, float]) -> float:
    """How many times the unpatched model's time a candidate of `family` takes at the ranking stage (None: the
    costliest family): its seconds in `by_family` (guard read included) against the unpatched model's
    `ranking_samples` ranking samples and guard read in `estimate`; 1 while none are measured."""
    if family == "none" or not by_family:
        return 1.0
    costliest = max(by_family.values())
    seconds = costliest if family is None else by_family.get(family, costliest)
    return max(1.0, seconds / (ranking_samples * estimate["rank_sample"] + estimate["guard"]))


def _key(spec: dict) -> str:
    return json.dumps(spec, sort_keys=True)


def _guard_key(cell: dict) -> str:
    fam = space.FAMILIES.get(cell["family"])
    return json.dumps([cell["family"], fam.short_key(cell["params"]) if fam else None], sort_keys=True)


def _guard_share(candidates: list[tuple[str, dict]], setting: space.Setting) -> float:
    """The share of `candidates` that read the guard's text (the first of each short-context setting)."""
    keys = {_guard_key({"family": f, "params": p}) for f, p in candidates}
    return len(keys) / max(1, len(candidates))


