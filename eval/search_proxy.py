"""Does a proxy sample rank candidates as the full-length score does? For every candidate of a finished hfpatch
search that scored at full length (`--proxy-tokens 0`), the score on proxy samples of each design (tokens x
segments), and Spearman's rank correlation between the two over all candidates, the starting points included.

    hfpatch search --target-length 16k --text-files BOOKS/dracula.txt --budget 24 --proxy-tokens 0 \\
        --out eval/results/search/dracula_16k_full
    python -m eval.search_proxy --full eval/results/search/dracula_16k_full/results.json \\
        --text-files BOOKS/dracula.txt --designs 4096x4,4096x16 --out eval/results/search/proxy_16k.json

The model is loaded as the search loaded it (its dtype is in the search's identity); the proxy samples are built
from the search's own full samples (the same text, seed and span), and each candidate's guard record is the
search's own. Every candidate's proxy
score is written to --out as soon as it is computed; the same command resumes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from hfpatch.evaluate.common import applied
from hfpatch.lm import text as texts
from hfpatch.lm.causal import causal_lm_parts
from hfpatch.lm.tokenizer import load_tokenizer
from hfpatch.models import load
from hfpatch.search import objective
from hfpatch.utils.files import write_text
from hfpatch.utils.modes import evaluating

DTYPES = {"torch.bfloat16": torch.bfloat16, "torch.float32": torch.float32, "torch.float16": torch.float16}


def ranks(values: list[float]) -> list[float]:
    """Ranks from 1, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rank correlation: Pearson's correlation of the ranks (None for fewer than 3 pairs)."""
    if len(a) < 3:
        return None
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va, vb = sum((x - ma) ** 2 for x in ra), sum((y - mb) ** 2 for y in rb)
    return cov / (va * vb) ** 0.5 if va and vb else None


def parse_design(text: str) -> tuple[int, int]:
    tokens, _, segments = text.partition("x")
    return int(tokens), int(segments)


def correlations(cells: list[dict], design: dict, guard: float) -> dict:
    """Spearman between the full-length and the proxy scores (the score, and its needle and plain parts), over every
    candidate, and over the feasible ones."""
    rows = [(c, design["scores"][c["patch"]]) for c in cells if c["patch"] in design["scores"]]
    base = next(c["short_ppl"] for c in cells if c["patch"] == "g0c0")
    out = {"candidates": len(rows)}
    for key in ("score", "needle_ppl", "plain_ppl"):
        pairs = [(c[key], p[key]) for c, p in rows if c.get(key) is not None and p.get(key) is not None]
        out[key] = spearman([a for a, _ in pairs], [b for _, b in pairs])
    feasible = [(c["score"], p["score"]) for c, p in rows if objective.feasible(c, base, guard)]
    out["score_feasible"] = spearman([a for a, _ in feasible], [b for _, b in feasible])
    out["feasible_candidates"] = len(feasible)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--full", required=True, help="results.json of a search with --proxy-tokens 0")
    p.add_argument("--text-files", nargs="+", required=True, help="the search's calibration text")
    p.add_argument("--designs", default="4096x4,4096x16", help="proxy designs TOKENSxSEGMENTS, comma-separated")
    p.add_argument("--samples", type=int, default=2, help="proxy samples per candidate")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    full = json.loads(Path(args.full).read_text())
    ident = full["identity"]
    if ident["proxy"]:
        raise SystemExit(f"{args.full}: a search with a proxy stage; give one with --proxy-tokens 0")
    cells = [c for c in full["cells"] if c.get("complete") and c.get("score") is not None]
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {"full": args.full, "identity": ident, "designs": {}}
    model, _ = load(args.model, dtype=DTYPES[ident["dtype"]], tokenizer=False)
    tok = load_tokenizer(args.model)
    parts = causal_lm_parts(model)
    text = objective.calibration_ids(tok, texts.text_files(args.text_files))
    with evaluating(model):
        for design in args.designs.split(","):
            tokens, segments = parse_design(design)
            entry = data["designs"].setdefault(design, {"tokens": tokens, "segments": segments, "samples":
                                                        args.samples, "scores": {}, "seconds": {}})
            full_samples = objective.build(tok, text, ident["target_length"], ident["window"], args.samples,
                                           ident["span"], ident["seed"])
            samples = objective.build_proxy(tok, full_samples, tokens, segments, ident["span"])
            for c in cells:
                if c["patch"] in entry["scores"]:
                    continue
                guard = [r for r in c["samples"] if "short_nll" in r]
                start = time.perf_counter()
                with applied(model, c["spec"], c["patch"]):
                    records = [objective.score_sample(parts, s) for s in samples]
                entry["scores"][c["patch"]] = objective.summarize(records + guard, ident["needle_weight"])
                entry["seconds"][c["patch"]] = round(time.perf_counter() - start, 2)
                entry["correlation"] = correlations(cells, entry, ident["guard"])
                write_text(out, json.dumps(data, indent=1) + "\n")
                print(f"{design} {c['patch']} {entry['scores'][c['patch']]['score']:.4f} (full {c['score']:.4f}) "
                      f"{entry['seconds'][c['patch']]} s", file=sys.stderr, flush=True)
            print(f"{design}: {json.dumps(entry.get('correlation'))}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
