"""Cross-engine agreement: every RoPE scheme a GGUF can carry, measured in transformers and in llama.cpp on the same
tokens, and each cell's gap between the engines set against the unpatched model's own gap at that length.

    python -m eval.cross_engine                      # SmolLM2-135M (Q4_1 GGUF), one book, 2k
    python -m eval.cross_engine --lengths 8k,16k --windows 1 --passkey-trials 2

For each engine it runs `hfpatch eval ppl` and `hfpatch eval passkey` (--engine transformers / llama.cpp) with the
same arguments, into OUT/LENGTHS/{ppl,passkey}-{engine}/ (LENGTHS e.g. 2k or 8k-16k; resumable: a rerun continues
them), then writes OUT/LENGTHS/cross_engine.json and prints the table. The passkey runs at the longest length.
Perplexity: the first `--windows` windows of the longest length of the book, in chunks. The gap of a cell is
|NLL_llama.cpp - NLL_transformers| / NLL_transformers (mean NLL per token); the ratio is that gap over the unpatched
model's gap at the same length: both engines run the same quantized weights (transformers dequantizes them to fp32),
so the unpatched gap is what the engines differ by without any patch. Schemes a GGUF cannot carry are listed with the
reason instead of a number. Needs llama-cpp-python (pip install 'hfpatch[llama-cpp]').
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import gguf

from hfpatch import spec as specs
from hfpatch.evaluate import evaluation
from hfpatch.evaluate.common import length_label, parse_lengths
from hfpatch.evaluate.report import markdown_table
from hfpatch.interop import gguf as hg
from hfpatch.models import gguf_path

HERE = Path(__file__).resolve().parent
BOOKS = HERE.parent.parent / "shared" / "data" / "books"
ENGINES = ("transformers", "llama.cpp")
# the schemes a GGUF carries, at the factors the comparison uses; llama3 only where the architecture reads rope_freqs
SPECS = ("none", "linear:2", "ntk:2", "yarn:2", "yarn:4", "llama3:4")
REFUSED = ("dynamic", "dynamic-yarn")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="a .gguf file, or smollm2 (default)")
    p.add_argument("--lengths", default="2k")
    p.add_argument("--book", default=str(BOOKS / "moby_dick.txt"), help="one text file (default: Moby Dick)")
    p.add_argument("--windows", type=int, default=2, help="windows of the longest length scored per cell (default 2)")
    p.add_argument("--passkey-trials", type=int, default=2, dest="trials", help="keys per length (default 2)")
    p.add_argument("--llama-cpp-trials", type=int, dest="llama_cpp_trials",
                   help="keys per length in llama.cpp, where a long prompt costs more (default: --passkey-trials); "
                        "the passkey columns compare the keys both engines were given")
    p.add_argument("--out", default=str(HERE / "results" / "cross_engine"))
    p.add_argument("--machine", default=f"{os.cpu_count()} CPU cores, no GPU",
                   help="what it ran on, for the results file (default: the CPU count)")
    p.add_argument("--combine-only", action="store_true",
                   help="run nothing: make the table from the results files already in OUT/LENGTHS")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.engine_trials = {"transformers": args.trials, "llama.cpp": args.llama_cpp_trials or args.trials}
    # one folder per set of lengths: the windows scored depend on the longest length, so another set is another run
    args.out = str(Path(args.out) / "-".join(length_label(n) for n in parse_lengths(args.lengths)))
    return args


def plan(model: str) -> tuple[list[str], dict]:
    """(specs to measure, {spec: why it is not measured}) for this GGUF."""
    path = gguf_path(model)
    if path is None:
        raise SystemExit(f"eval.cross_engine compares engines on a GGUF file; {model} is not one")
    info = hg.read_rope(gguf.GGUFReader(path))
    run, skipped = [], {}
    for raw in SPECS:
        kwargs = specs.parse(raw)
        try:
            hg.plan(info, hg.request(**kwargs)) if kwargs else None
            run.append(raw)
        except ValueError as e:
            skipped[raw] = str(e)
    for scheme in REFUSED:
        skipped[scheme] = hg.refusal(scheme)
    return run, skipped


def measure(args, run: list[str]) -> None:
    longest = max(parse_lengths(args.lengths))
    for engine in ENGINES:
        common = ["--model", args.model, "--engine", engine, "--lengths", args.lengths, "--patches", ",".join(run),
                  "--no-plot"]
        per_doc = str(args.windows * longest)
        rc = evaluation("ppl").main([*common, "--text-files", args.book, "--tokens-per-doc", per_doc,
                                     "--out", f"{args.out}/ppl-{engine}"])
        # the passkey at the longest length only: what an extension is for (and the costliest read of the run)
        rc = rc or evaluation("passkey").main([*common, "--lengths", str(longest), "--depths", "0.5",
                                               "--trials", str(args.engine_trials[engine]),
                                               "--out", f"{args.out}/passkey-{engine}"])
        if rc:
            raise SystemExit(rc)


def _cells(path: Path) -> dict:
    data = json.loads(path.read_text())
    return {(c["patch"], c["length"]): c for c in data["cells"] if c.get("complete")}


def combine(args, run: list[str], skipped: dict) -> dict:
    out = Path(args.out)
    ppl = {e: _cells(out / f"ppl-{e}" / "results.json") for e in ENGINES}
    keys = {e: _cells(out / f"passkey-{e}" / "results.json") for e in ENGINES}
    longest = max(parse_lengths(args.lengths))
    rows = []
    for n in parse_lengths(args.lengths):
        base = None
        for spec in run:
            tf, lc = (ppl[e][(spec, n)]["mean_nll"] for e in ENGINES)
            gap = abs(lc - tf) / tf
            if spec == "none":
                base = gap
            rows.append({"patch": spec, "length": n, "nll_transformers": tf, "nll_llama.cpp": lc, "gap": gap,
                         "gap_over_unpatched": gap / base if base else None,
                         "tokens": ppl["transformers"][(spec, n)]["tokens"],
                         **(_passkeys(keys, spec, n) if n == longest else {})})
    command = "python -m eval.cross_engine " + " ".join(args.argv)
    if args.combine_only and (out / "cross_engine.json").exists():  # the command that measured, not this one
        command = json.loads((out / "cross_engine.json").read_text())["command"]
    result = {"command": command, "machine": args.machine,
              "model": args.model, "book": Path(args.book).name, "lengths": parse_lengths(args.lengths),
              "windows": args.windows, "passkey_trials": args.engine_trials, "cells": rows, "not_measured": skipped}
    (out / "cross_engine.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _passkeys(keys: dict, spec: str, n: int) -> dict:
    """Keys found in each engine, over the keys both were given (the same prompts: a trial's key depends on the
    length, depth and trial number only): {"passkey_keys": k, "passkey_<engine>": found}; {} where either engine
    has no complete cell."""
    cells = [keys[e].get((spec, n)) for e in ENGINES]
    if None in cells:
        return {}
    given = [{t["key"]: t["correct"] for t in c["trials"]} for c in cells]
    common = [k for k in given[0] if k in given[1]]
    found = {f"passkey_{e}": sum(g[k] for k in common) for e, g in zip(ENGINES, given, strict=True)}
    return {"passkey_keys": len(common), **found}


def table(result: dict) -> str:
    rows = []
    for r in result["cells"]:
        ratio = r["gap_over_unpatched"]
        rows.append([r["patch"], length_label(r["length"]), f"{r['nll_transformers']:.5f}", f"{r['nll_llama.cpp']:.5f}",
                     f"{100 * r['gap']:.3f} %", "-" if r["patch"] == "none" else f"{ratio:.2f}",
                     *(f"{r[f'passkey_{e}']}/{r['passkey_keys']}" if "passkey_keys" in r else "-"
                       for e in ENGINES)])
    text = markdown_table(["patch", "length", "NLL transformers", "NLL llama.cpp", "gap", "gap / unpatched gap",
                           "passkey found: transformers", "llama.cpp"], rows)
    if result["not_measured"]:
        text += "\n\nNot measured:\n" + "\n".join(f"- `{k}`: {v}" for k, v in result["not_measured"].items())
    return text


def main(argv=None) -> int:
    args = parse_args(argv)
    if not Path(args.book).is_file():
        raise SystemExit(f"no such book: {args.book}")
    run, skipped = plan(args.model)
    if not args.combine_only:
        measure(args, run)
    result = combine(args, run, skipped)
    print(f"{result['model']}, {result['book']}: mean NLL per token over {result['windows']} window(s) per length; "
          "passkey at depth 0.5, keys found of those both engines were given\n")
    print(table(result))
    worst = max((r["gap_over_unpatched"] for r in result["cells"] if r["patch"] != "none"), default=None)
    if worst is not None and not math.isnan(worst):
        print(f"\nlargest gap / unpatched gap: {worst:.2f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
