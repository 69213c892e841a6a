"""Cross-engine agreement: every RoPE scheme a GGUF or a saved checkpoint can carry, measured in transformers, in
llama.cpp and in vLLM on the same tokens, and each cell's gap between an engine and transformers set against the
unpatched model's own gap at that length.

    python -m eval.cross_engine                      # SmolLM2-135M (Q4_1 GGUF), one book, 2k, all three engines
    python -m eval.cross_engine --lengths 8k,16k --windows 1 --passkey-trials 2
    python -m eval.cross_engine --engines transformers,vllm --engine-python ~/.cache/hfpatch/vllm/bin/python

For each engine it runs `hfpatch eval ppl` and `hfpatch eval passkey` (--engine transformers / llama.cpp / vllm) with
the same arguments, into OUT/LENGTHS/{ppl,passkey}-{engine}/ (LENGTHS e.g. 2k or 8k-16k; resumable: a rerun
continues them), then writes OUT/LENGTHS/cross_engine.json from every engine's results found there and prints the
table. The passkey runs at the longest length. Perplexity: the first `--windows` windows of the longest length of the
book, in chunks. The gap of a cell is |NLL_engine - NLL_transformers| / NLL_transformers (mean NLL per token); the
ratio is that gap over the unpatched model's gap between the same engines at the same length, what the engines
differ by without any patch: llama.cpp runs the GGUF's quantized weights, which transformers dequantizes to fp32;
vLLM runs the folder hfpatch.save_pretrained writes of that fp32 model. Schemes an engine cannot carry are listed
with the reason instead of a number. llama.cpp needs llama-cpp-python (pip install 'hfpatch[llama-cpp]'); vLLM its
own environment (eval/vllm_venv.sh).
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
from hfpatch.evaluate import engines, evaluation
from hfpatch.evaluate.common import length_label, parse_lengths
from hfpatch.evaluate.report import markdown_table
from hfpatch.interop import gguf as hg
from hfpatch.models import gguf_path

HERE = Path(__file__).resolve().parent
BOOKS = HERE.parent.parent / "shared" / "data" / "books"
ENGINES = tuple(engines.ENGINES)  # hfpatch's engines, as --engine names them
OTHERS = tuple(e for e in ENGINES if e != engines.DEFAULT)  # each compared with transformers
# the schemes compared, at the factors the comparison uses; llama3 only where the architecture reads rope_freqs
SPECS = ("none", "linear:2", "ntk:2", "yarn:2", "yarn:4", "llama3:4")
# LongRoPE with SmolLM2's 32 frequency pairs: plain RoPE within the trained window, a ramp from 1 (the fastest pair)
# to 4 (the slowest) beyond it
LONGROPE = ("longrope:4:short_factor=[" + ",".join(["1"] * 32) + "]:long_factor=["
            + ",".join(f"{1 + 3 * i / 31:.4f}" for i in range(32)) + "]")
VLLM_SPECS = (*SPECS, "dynamic", LONGROPE)
PASSKEY_NEW_TOKENS = 12  # hfpatch eval passkey's --new-tokens (its default), generated after each prompt
REFUSED = ("dynamic", "dynamic-yarn")  # by every GGUF


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
    p.add_argument("--engines", default=",".join(ENGINES),
                   help=f"the engines to run, comma-separated (default {','.join(ENGINES)}); the table compares "
                        "every engine whose results are in OUT/LENGTHS")
    p.add_argument("--engine-python", dest="engine_python", help="vLLM's Python (hfpatch eval --engine-python)")
    p.add_argument("--out", default=str(HERE / "results" / "cross_engine"))
    p.add_argument("--machine", default=f"{os.cpu_count()} CPU cores, no GPU",
                   help="what it ran on, for the results file (default: the CPU count)")
    p.add_argument("--combine-only", action="store_true",
                   help="run nothing: make the table from the results files already in OUT/LENGTHS")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.engine_trials = {"transformers": args.trials, "llama.cpp": args.llama_cpp_trials or args.trials,
                          "vllm": args.trials}
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in args.engines if e not in ENGINES]
    if unknown:
        p.error(f"unknown engine(s) {', '.join(unknown)}; the engines are {', '.join(ENGINES)}")
    # one folder per set of lengths: the windows scored depend on the longest length, so another set is another run
    args.out = str(Path(args.out) / "-".join(length_label(n) for n in parse_lengths(args.lengths)))
    return args


def plan(model: str, lengths: list[int]) -> dict:
    """{engine: (specs to measure, {spec: why it is not measured})}; transformers runs every spec another engine
    runs."""
    plans = {"llama.cpp": plan_llama_cpp(model), "vllm": plan_vllm(model, lengths)}
    every = list(dict.fromkeys(s for run, _ in plans.values() for s in run))
    return {"transformers": (every, {}), **plans}


def plan_vllm(model: str, lengths: list[int]) -> tuple[list[str], dict]:
    """(specs to measure, {spec: why not}) in vLLM: what vllm_engine.refusal says of each spec on the loaded model,
    for the perplexity at the longest length; a spec whose passkey vLLM refuses (the prompt and its answer run past
    what vLLM serves) is listed as passkey_key(spec, longest)."""
    from hfpatch.evaluate.common import applied
    from hfpatch.evaluate.vllm_engine import refusal
    from hfpatch.models import load

    loaded, _ = load(model, tokenizer=False)
    longest = max(lengths)
    run, skipped = [], {}
    for raw in VLLM_SPECS:
        with applied(loaded, specs.parse(raw), raw):
            reason, passkey = refusal(loaded, longest), refusal(loaded, longest + PASSKEY_NEW_TOKENS)
        if reason:
            skipped[raw] = reason
            continue
        run.append(raw)
        if passkey:
            skipped[passkey_key(raw, longest)] = passkey
    return run, skipped


def passkey_key(spec: str, length: int) -> str:
    """How a spec whose passkey an engine refuses at `length` (its perplexity measured) is listed as not measured."""
    return f"{spec} (passkey at {length_label(length)})"


def plan_llama_cpp(model: str) -> tuple[list[str], dict]:
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


def measure(args, plans: dict) -> None:
    longest = max(parse_lengths(args.lengths))
    for engine in args.engines:
        run, skipped = plans[engine]
        common = ["--model", args.model, "--engine", engine, "--lengths", args.lengths, "--patches", ",".join(run),
                  "--no-plot"]
        passkey_specs = [s for s in run if passkey_key(s, longest) not in skipped]
        if engine == "vllm" and args.engine_python:
            common += ["--engine-python", args.engine_python]
        per_doc = str(args.windows * longest)
        rc = evaluation("ppl").main([*common, "--text-files", args.book, "--tokens-per-doc", per_doc,
                                     "--out", f"{args.out}/ppl-{engine}"])
        # the passkey at the longest length only: what an extension is for (and the costliest read of the run)
        common[common.index("--patches") + 1] = ",".join(passkey_specs)
        if not rc and passkey_specs:
            rc = evaluation("passkey").main([*common, "--lengths", str(longest), "--depths", "0.5",
                                             "--trials", str(args.engine_trials[engine]),
                                             "--out", f"{args.out}/passkey-{engine}"])
        if rc:
            raise SystemExit(rc)


def _cells(path: Path) -> dict:
    if not path.is_file():  # an engine not run here
        return {}
    data = json.loads(path.read_text())
    return {(c["patch"], c["length"]): c for c in data["cells"] if c.get("complete")}


def combine(args, plans: dict) -> dict:
    out = Path(args.out)
    ppl = {e: _cells(out / f"ppl-{e}" / "results.json") for e in ENGINES}
    keys = {e: _cells(out / f"passkey-{e}" / "results.json") for e in ENGINES}
    engines = [e for e in OTHERS if ppl[e]]  # those with results here
    longest = max(parse_lengths(args.lengths))
    rows = []
    for n in parse_lengths(args.lengths):
        base: dict = {}
        for spec in plans["transformers"][0]:
            if (spec, n) not in ppl["transformers"]:
                continue
            tf = ppl["transformers"][(spec, n)]["mean_nll"]
            row = {"patch": spec, "length": n, "nll": {"transformers": tf}, "gap": {}, "gap_over_unpatched": {},
                   "tokens": ppl["transformers"][(spec, n)]["tokens"], "passkey": {}}
            for e in engines:
                if (spec, n) not in ppl[e]:
                    continue
                other = ppl[e][(spec, n)]["mean_nll"]
                gap = abs(other - tf) / tf
                if spec == "none":
                    base[e] = gap
                row["nll"][e], row["gap"][e] = other, gap
                row["gap_over_unpatched"][e] = gap / base[e] if base.get(e) else None
            if n == longest:
                row["passkey"] = {e: _passkeys(keys, spec, n, e) for e in engines if _passkeys(keys, spec, n, e)}
            rows.append(row)
    command = "python -m eval.cross_engine " + " ".join(args.argv)
    machine = args.machine
    if args.combine_only and (out / "cross_engine.json").exists():  # the command that measured, not this one
        before = json.loads((out / "cross_engine.json").read_text())
        command, machine = before["command"], before.get("machine", machine)
    result = {"command": command, "machine": machine,
              "model": args.model, "book": Path(args.book).name, "lengths": parse_lengths(args.lengths),
              "windows": args.windows, "engines": ["transformers", *engines],
              "passkey_trials": {e: args.engine_trials[e] for e in ["transformers", *engines]}, "cells": rows,
              "not_measured": {e: plans[e][1] for e in engines if plans[e][1]}}
    (out / "cross_engine.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _passkeys(keys: dict, spec: str, n: int, engine: str) -> dict:
    """Keys found by transformers and by `engine`, over the keys both were given (the same prompts: a trial's key
    depends on the length, depth and trial number only): {"keys": k, "transformers": found, engine: found}; {} where
    either has no complete cell."""
    pair = ("transformers", engine)
    cells = [keys[e].get((spec, n)) for e in pair]
    if None in cells:
        return {}
    given = [{t["key"]: t["correct"] for t in c["trials"]} for c in cells]
    common = [k for k in given[0] if k in given[1]]
    return {"keys": len(common), **{e: sum(g[k] for k in common) for e, g in zip(pair, given, strict=True)}}


def label(spec: str) -> str:
    """A spec as the table shows it: LongRoPE's factor lists left out (the results file keeps them)."""
    return spec.split(":short_factor")[0] if spec.startswith("longrope") else spec


def percent(gap: float) -> str:
    """A gap in percent: three decimals, or two significant digits below 0.001 % (float32 engines agree to ~1e-7)."""
    return f"{100 * gap:.3f} %" if gap == 0 or 100 * gap >= 1e-3 else f"{100 * gap:.1e} %"


def table(result: dict) -> str:
    engines = result["engines"][1:]
    rows = []
    for r in result["cells"]:
        cells = [label(r["patch"]), length_label(r["length"]), f"{r['nll']['transformers']:.5f}"]
        for e in engines:
            if e not in r["nll"]:
                cells += ["-"] * 3
                continue
            ratio = r["gap_over_unpatched"][e]
            cells += [f"{r['nll'][e]:.5f}", percent(r["gap"][e]),
                      "-" if r["patch"] == "none" or ratio is None else f"{ratio:.2f}"]
        for e in engines:
            found = r["passkey"].get(e)
            cells.append(f"{found['transformers']}/{found['keys']} vs {found[e]}/{found['keys']}" if found else "-")
        rows.append(cells)
    header = ["patch", "length", "NLL transformers"]
    for e in engines:
        header += [f"NLL {e}", f"gap {e}", "gap / unpatched gap"]
    header += [f"passkey found: transformers vs {e}" for e in engines]
    text = markdown_table(header, rows)
    for e, skipped in result["not_measured"].items():
        text += f"\n\nNot measured in {e}:\n" + "\n".join(f"- `{label(k)}`: {v}" for k, v in skipped.items())
    return text


def main(argv=None) -> int:
    args = parse_args(argv)
    if not Path(args.book).is_file():
        raise SystemExit(f"no such book: {args.book}")
    plans = plan(args.model, parse_lengths(args.lengths))
    if not args.combine_only:
        measure(args, plans)
    result = combine(args, plans)
    print(f"{result['model']}, {result['book']}: mean NLL per token over {result['windows']} window(s) per length; "
          "passkey at depth 0.5, keys found of those both engines were given\n")
    print(table(result))
    for e in result["engines"][1:]:
        ratios = [r["gap_over_unpatched"].get(e) for r in result["cells"] if r["patch"] != "none"]
        worst = max((x for x in ratios if x is not None and not math.isnan(x)), default=None)
        if worst is not None:
            print(f"\nlargest gap / unpatched gap, {e}: {worst:.2f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
