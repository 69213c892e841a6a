"""The search study's arms and its needle-driven measure: the patch a search found against the fixed rescalings on
text the search never saw.

    python -m eval.search_study patches --best SEARCH_OUT/best.json
        the arms as one --patches value for hfpatch eval ppl / passkey (found, none, linear:2, ntk:2, yarn:2, llama3:2,
        longrope with the NTK formula's factors, self-extend, dual-chunk)
    python -m eval.search_study passkey-arms --ppl PPL_DIR/results.json --best .../best.json
        the passkey cells' arms, as one --patches value: the found patch, yarn:2, and the other arm with the lowest
        perplexity at the longest length of hfpatch eval ppl's results of the arms
    python -m eval.search_study needle --best ... --text-files BOOK --out eval/results/search/needle_moby.json
        the search's own objective (needle-driven perplexity: objective.py) at the target length on BOOK, per arm;
        written after every sample, resumed by the same command

The arms' factor is the extension ratio, target / trained window (2 at 16k for SmolLM2's 8k window).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import hfpatch
from hfpatch.evaluate.common import applied, parse_patches
from hfpatch.lm import text as texts
from hfpatch.lm.causal import causal_lm_parts
from hfpatch.lm.tokenizer import load_tokenizer
from hfpatch.models import load
from hfpatch.search import objective
from hfpatch.utils.files import write_text
from hfpatch.utils.modes import evaluating

WINDOW, TARGET, PAIRS = 8192, 16384, 32  # SmolLM2-135M: trained window, the study's target, rotary pairs (64 / 2)


def spec_string(kwargs: dict) -> str:
    """hfpatch.patch's keyword arguments as a spec string that parse_patches reads back whole."""
    if not kwargs:
        return "none"
    rest = {k: v for k, v in kwargs.items() if k not in ("position", "factor")}

    def value(v: object) -> str:
        return "[" + ",".join(repr(float(x)) for x in v) + "]" if isinstance(v, list) else str(v)

    head = [kwargs["position"], *([repr(float(kwargs["factor"]))] if "factor" in kwargs else [])]
    return ":".join(head + [f"{k}={value(v)}" for k, v in rest.items()])


def ntk_formula_longrope(ratio: float, pairs: int = PAIRS, window: int = WINDOW) -> dict:
    """LongRoPE with a plain formula's factors: NTK-aware interpolation per pair, λ_i = s^(2i / (d - 2)) (the base
    change θ' = θ s^(d / (d - 2)) written pair by pair), the attention factor left to transformers' default."""
    d = 2 * pairs
    factors = [ratio ** (2 * i / (d - 2)) for i in range(pairs)]
    return {"position": "longrope", "factor": ratio, "original_max_position_embeddings": window,
            "short_factor": [1.0] * pairs, "long_factor": factors}


def arms(best: dict, ratio: float) -> list[str]:
    """The found patch (best.json's keyword arguments; {}: none found), then the fixed arms that are another patch
    (hfpatch eval refuses the same patch twice)."""
    fixed = ["none", *(f"{s}:{ratio:g}" for s in ("linear", "ntk", "yarn", "llama3")),
             spec_string(ntk_formula_longrope(ratio)), "self-extend", "dual-chunk"]
    if not best:
        return fixed
    found = canonical(spec_string(best))
    return [spec_string(best), *[a for a in fixed if canonical(a) != found]]


def canonical(spec: str) -> str:
    """The patch a spec string asks for, in one spelling (yarn:4 and yarn:4.0 are the same)."""
    return json.dumps(hfpatch.spec.request(**hfpatch.spec.parse(spec)), sort_keys=True)


def passkey_arms(ppl: dict | None, best: dict, ratio: float) -> list[str]:
    """The arms of the passkey cells: the found patch (if any), yarn at the ratio, and, of the other arms, the one
    with the lowest perplexity at the longest length in `ppl` (hfpatch eval ppl's results of `arms`; no such arm
    when it holds no complete cell of one)."""
    every = arms(best, ratio)
    chosen = every[:1] if best else []
    yarn = f"yarn:{ratio:g}"
    if yarn in every:
        chosen.append(yarn)
    cells = [c for c in (ppl or {}).get("cells", []) if c.get("complete") and c["patch"] in every
             and c["patch"] not in chosen]
    if cells:
        longest = max(c["length"] for c in cells)
        chosen.append(min((c for c in cells if c["length"] == longest), key=lambda c: c["ppl"])["patch"])
    return chosen


def needle(args: argparse.Namespace) -> int:
    patches = parse_patches(args.patches)
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {"book": args.text_files, "target": args.target,
                                                             "samples": args.samples, "dtype": args.dtype, "arms": {}}
    model, _ = load("smollm2", dtype=getattr(torch, args.dtype), tokenizer=False)
    tok = load_tokenizer("smollm2")
    parts = causal_lm_parts(model)
    text = objective.calibration_ids(tok, texts.text_files(args.text_files))
    samples = objective.build(tok, text, args.target, WINDOW, args.samples, 32, args.seed)
    with evaluating(model):
        for name, kwargs in patches:
            arm = data["arms"].setdefault(name, {"spec": kwargs, "records": []})
            with applied(model, kwargs, name):
                for k in range(len(arm["records"]), len(samples)):
                    start = time.perf_counter()
                    arm["records"].append({"sample": k, **objective.score_sample(parts, samples[k]),
                                           "seconds": round(time.perf_counter() - start, 1)})
                    arm.update(objective.summarize(arm["records"], 0.5))
                    write_text(out, json.dumps(data, indent=1) + "\n")
                    print(f"{name[:60]} sample {k}: needle {arm['needle_ppl']:.2f} plain {arm['plain_ppl']:.2f}",
                          file=sys.stderr, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("patches")
    a.add_argument("--best", help="best.json of the search (default: no found patch)")
    a.add_argument("--ratio", type=float, default=TARGET / WINDOW)
    k = sub.add_parser("passkey-arms")
    k.add_argument("--ppl", required=True, help="results.json of hfpatch eval ppl over the arms (`patches`); a "
                   "missing file leaves the best other arm out")
    k.add_argument("--best", help="best.json of the search (default: no found patch)")
    k.add_argument("--ratio", type=float, default=TARGET / WINDOW)
    n = sub.add_parser("needle")
    n.add_argument("--patches", required=True)
    n.add_argument("--text-files", nargs="+", required=True)
    n.add_argument("--target", type=int, default=TARGET)
    n.add_argument("--samples", type=int, default=2)
    n.add_argument("--seed", type=int, default=0)
    n.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    n.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.what in ("patches", "passkey-arms"):
        best = json.loads(Path(args.best).read_text()) if args.best else {}
        hfpatch.spec.request(**best) if best else None
        if args.what == "patches":
            print(",".join(arms(best, args.ratio)))
            return 0
        ppl = Path(args.ppl)
        if not ppl.is_file():
            print(f"search_study passkey-arms: {ppl} is missing: the best other arm is left out", file=sys.stderr)
        print(",".join(passkey_arms(json.loads(ppl.read_text()) if ppl.is_file() else None, best, args.ratio)))
        return 0
    return needle(args)


if __name__ == "__main__":
    raise SystemExit(main())
