"""Echo: random tokens read twice in one window; the mean NLL of the second copy, by length.

    hfpatch eval echo [--lengths 256,1k] [--trials 2] [--seed 0] [--patches none,yarn:2] [--out runs/echo]

Each trial draws length / 2 tokens at random (the tokenizer's ordinary ones, from an RNG seeded by (seed, length,
trial): every patch spec sees the same tokens) and the model reads them twice in one window; only the second copy
is scored. A model that attends back across the whole window copies it (NLL near 0), one that cannot sees random
tokens (NLL near ln of the vocabulary).

An evaluation as a user outside hfpatch writes it (docs/extending.md, "An evaluation"): this module, named as the
evaluation, and one `hfpatch.evaluate.evaluations.register("echo", "echo")` call.
tests/test_outside_extensions.py registers it and runs it through hfpatch.evaluate.run and `hfpatch eval echo`.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any, ClassVar

from hfpatch.evaluate import definition, plots, report
from hfpatch.evaluate.parsing import length_label, parse_lengths

SCORE_CHUNK = 1024  # positions per LM-head chunk


def ordinary_ids(tok: Any) -> list[int]:
    """The tokenizer's ids, its special tokens left out."""
    return sorted(set(tok.get_vocab().values()) - set(tok.all_special_ids))


def echo_ids(vocab: list[int], length: int, seed: int, trial: int) -> list[int]:
    """length // 2 tokens drawn from `vocab`, twice."""
    half = random.Random(f"{seed}:{length}:{trial}").choices(vocab, k=length // 2)
    return half + half


class Echo(definition.Evaluation):
    records, unit_key = "trials", "trial"  # the cell field with one record per unit; the record's id field
    axes: ClassVar[dict[str, str]] = {"lengths": "length"}  # settings key -> the cell field it lists

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--lengths", default="256,1k", help="window lengths in tokens, k = 1024 (default 256,1k)")
        p.add_argument("--trials", type=int, default=2, help="random sequences per (patch, length) (default 2)")
        p.add_argument("--seed", type=int, default=0)

    def plan(self, args: argparse.Namespace, tok: Any) -> definition.Plan:
        lengths = parse_lengths(args.lengths)
        definition.check_count("--trials", args.trials)
        vocab = ordinary_ids(tok)
        cells = []
        for n in lengths:
            # one window of 2 * (n // 2) tokens: it reads all but the last, and scores the second half
            read, scored = 2 * (n // 2) - 1, n // 2
            units = [definition.Unit(t, [(read, read, scored)], echo_ids(vocab, n, args.seed, t))
                     for t in range(args.trials)]
            cells.append(definition.Cell({"length": n}, units))
        identity = {"model": args.model, "dtype": args.dtype, "seed": args.seed}
        settings = {"lengths": lengths, "trials": args.trials, "dtype": args.dtype, "device_map": args.device_map}
        return definition.Plan(identity, cells, read=max(lengths), score_chunk=SCORE_CHUNK, info={"settings": settings})

    def run_unit(self, run: Any, cell: dict, unit: Any, progress: Any) -> dict:
        ids = unit.data
        nll, tokens, _ = run.document_nll(ids, [(0, len(ids), len(ids) // 2)], SCORE_CHUNK, progress)
        return {"tokens": tokens, "nll_sum": nll}

    def summarize(self, records: list[dict]) -> dict:
        nll, tokens = sum(r["nll_sum"] for r in records), sum(r["tokens"] for r in records)
        return {"nll_sum": nll, "tokens": tokens, "mean_nll": nll / tokens}

    def caption(self, data: dict) -> str:
        name = data.get("model", {}).get("name", data["identity"]["model"])
        return f"{name}: echo, the second copy of {data['settings']['trials']} random sequence(s) per cell"

    def tables(self, data: dict) -> str:
        s = data["settings"]
        done = {(c["patch"], c["length"]): c for c in report.complete(data["cells"])}
        rows = [[p] + [report.number(done[(p, n)]["mean_nll"], 3) if (p, n) in done else "—" for n in s["lengths"]]
                for p in s["patches"]]
        return "**mean NLL of the second copy** (nats per token)\n\n" + report.markdown_table(
            ["patch"] + [length_label(n) for n in s["lengths"]], rows)

    def plot(self, data: dict, path: Path | str, title: str) -> None:
        s = data["settings"]
        done = {(c["patch"], c["length"]): c for c in report.complete(data["cells"])}
        fig = plots.figure(figsize=(6, 4))
        ax = fig.subplots()
        for p in s["patches"]:
            points = [(n, done[(p, n)]["mean_nll"]) for n in s["lengths"] if (p, n) in done]
            if points:
                ax.plot(*zip(*points), marker="o", label=p)
        plots.length_axis(ax, s["lengths"])
        ax.set_xlabel("window (tokens)")
        ax.set_ylabel("mean NLL of the second copy")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=100)


EVALUATION = Echo()
main = EVALUATION.main
