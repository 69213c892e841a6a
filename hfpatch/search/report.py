"""What a search's results file reads as: a candidate in a few words (`label`), the table of the best candidate
against the starting points and the unpatched model, its caption, and the convergence plot. Drawn from the results
file's data alone, with the evaluations' tables and figures (evaluate/report.py, evaluate/plots.py)."""

from __future__ import annotations

import math
from pathlib import Path

from ..evaluate.parsing import length_label
from ..evaluate.plots import figure
from ..evaluate.report import markdown_table, number
from . import objective, space

REFERENCE = "g0c0"  # the unpatched model: the guard's reference, and the score a patch must beat
FULL = "/full"  # the suffix of a candidate's name in its full-length cell


def label(cell: dict) -> str:
    """A candidate in a few words: its family and the settings that tell it apart."""
    p, fam = cell["params"], cell["family"]
    if fam == "none":
        return "none"
    own = space.FAMILIES[fam].label if fam in space.FAMILIES else None
    if own is not None:
        text = fam + own(p)
    else:
        shown = {k: v for k, v in cell["spec"].items() if k not in ("position", "original_max_position_embeddings",
                                                                    "attention_temperature")}
        text = fam + " " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items())
    return text + (f" +{p['temperature']}" if p.get("temperature") else "")


def ranked_cells(data: dict) -> list[dict]:
    """The candidates of the ranking stage (the proxy's, or the full-length ones when there is no proxy)."""
    return [c for c in data["cells"] if not c["patch"].endswith(FULL)]


def full_cell(data: dict, name: str) -> dict | None:
    """The full-length cell of candidate `name`: its own cell when the search has no proxy stage."""
    proxy = data["identity"]["proxy"]
    want = name + FULL if proxy else name
    return next((c for c in data["cells"] if c["patch"] == want and c.get("complete")), None)


def _reference_short(data: dict) -> float | None:
    ref = next((c for c in data["cells"] if c["patch"] == REFERENCE and c.get("complete")), None)
    return ref.get("short_ppl") if ref else None


def _rise(cell: dict, base: float | None) -> str:
    return f"{100 * (cell['short_ppl'] / base - 1):+.2f} %" if base and cell.get("short_ppl") is not None else ""


def table(data: dict) -> str:
    """The best candidate, the finalists (with a proxy stage) and every starting point (generation 0), with their
    ranking score (the proxy's, when there is one) and their full-length numbers."""
    ident = data["identity"]
    guard, proxy = ident["guard"], ident["proxy"]
    base = _reference_short(data)
    best_name = data.get("best")
    ranked = [c for c in ranked_cells(data) if c.get("complete")]
    finalists = [c for c in ranked if c["patch"] == best_name
                 or (proxy and full_cell(data, c["patch"]) is not None and c["generation"] > 0)]
    chosen = sorted({c["patch"]: c for c in [*finalists, *(c for c in ranked if c["generation"] == 0)]}.values(),
                    key=lambda c: (c["patch"] != best_name, c["order"]))
    rows = []
    for c in chosen:
        full = full_cell(data, c["patch"]) or {}
        ok = "error: " + c["error"][:60] if c.get("error") else (
            "yes" if objective.feasible(c, base, guard) else "no (guard)")
        row = [("**best** " if c["patch"] == best_name else "") + c["patch"], label(c)]
        if proxy:
            row.append(number(c.get("score"), 4))
        row += [number(full.get("needle_ppl")) if full else "—", number(full.get("plain_ppl")) if full else "—",
                number(c.get("short_ppl")), _rise(c, base), number(full.get("score"), 4) if full else "—", ok]
        rows.append(row)
    header = ["candidate", "patch", *(["proxy score"] if proxy else []), "needle ppl", "plain ppl", "ppl at window",
              "vs none", "score", "feasible"]
    return markdown_table(header, rows)


def caption(data: dict) -> str:
    s = data["identity"]
    ranked = sum(bool(c.get("complete")) for c in ranked_cells(data))
    full = sum(bool(c.get("complete")) for c in data["cells"] if c["patch"].endswith(FULL))
    how = (f"{ranked} candidates ranked on {s['proxy_samples']} proxy sample(s) of {s['proxy']} tokens spanning "
           f"{length_label(s['target_length'])}, {full} scored at full length on {s['samples']} sample(s)"
           if s["proxy"] else f"{ranked} candidates scored on {s['samples']} sample(s)")
    return (f"hfpatch search: {s['model'].get('model_type', 'the model')} at {length_label(s['target_length'])} "
            f"(trained window {length_label(s['window'])}), {s['dtype'].removeprefix('torch.')}; {how}; score = "
            f"{s['needle_weight']:g} x needle NLL + {1 - s['needle_weight']:g} x plain NLL, guard "
            f"{100 * s['guard']:g} % at the window")


def plot(data: dict, path: Path) -> None:
    """Every ranked candidate's score in the order scored, and the best feasible score so far."""
    guard = data["identity"]["guard"]
    cells = sorted([c for c in ranked_cells(data) if c.get("complete") and c.get("score") is not None],
                   key=lambda c: c["order"])
    base = _reference_short(data)
    ref = next((c for c in cells if c["patch"] == REFERENCE), None)
    fig = figure(figsize=(7.5, 4.5))
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
    ax.set_ylabel(("proxy " if data["identity"]["proxy"] else "") + "score (nats)")
    fig.suptitle(caption(data), fontsize=7, wrap=True)
    ax.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(path, dpi=120)
