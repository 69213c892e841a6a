"""hfpatch search: the command line of the search (loop.search), with the evaluations' loading flags."""

from __future__ import annotations

import argparse
import sys

from ..evaluate.common import load_model, parse_length
from ..lm.tokenizer import load_tokenizer
from ..models import model_fingerprint
from ..utils import command
from . import space
from .loop import Options, check_options, parse_budget, search

PROG = "hfpatch search"


def build_parser() -> command.Parser:
    p = command.Parser(prog=PROG, description="find the training-free patch (LongRoPE per-pair RoPE factors, YaRN, "
                       "Self-Extend, Dual Chunk Attention settings) that minimises needle-driven perplexity at a "
                       "target length; writes OUT/best.json for hfpatch patch --spec-file")
    p.add_argument("--model", default="smollm2", help="hub id, local folder, .gguf file, or smollm2 (default)")
    p.add_argument("--target-length", required=True, type=_length, dest="target_length",
                   help="the length to extend to, e.g. 32k, 16384")
    p.add_argument("--budget", required=True, type=_budget,
                   help="wall time of this run (2h, 30m, 90s), a number of candidates in all (200), or both (2h,200)")
    p.add_argument("--text-files", nargs="+", dest="text_files",
                   help="calibration text: files or folders of .txt files (default: the standard-library corpus)")
    p.add_argument("--out", default="runs/search", help="folder for results.json, best.json, table.md and the plot "
                                                         "(default runs/search); the same command resumes it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--families", type=_families, default=None,
                   help=f"comma-separated: {', '.join(space.FAMILIES)} (default: all that apply)")
    p.add_argument("--population", type=int, default=8, help="candidates per generation (default 8)")
    p.add_argument("--parents", type=int, default=4, help="the best candidates new ones come from (default 4)")
    p.add_argument("--samples", type=int, default=2, help="calibration samples of the target length (default 2)")
    p.add_argument("--span", type=int, help="tokens of the repeated span (default min(32, window / 4))")
    p.add_argument("--needle-weight", type=float, default=0.5, dest="needle_weight",
                   help="weight of needle NLL in the score, the rest on plain NLL (default 0.5)")
    p.add_argument("--guard", type=float, default=0.01,
                   help="largest relative rise of perplexity at the trained window (default 0.01: 1 %%)")
    p.add_argument("--window", type=int, help="the trained window (default: the model's config)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16", "auto"], help="weights dtype (default fp32)")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)")
    p.add_argument("--overwrite", action="store_true", help="discard an existing results file instead of resuming")
    p.add_argument("--no-plot", action="store_true", dest="no_plot")
    p.add_argument("--no-progress", action="store_true", dest="no_progress")
    p.add_argument("--no-memory-check", action="store_true", dest="no_memory_check",
                   help="run even when the estimated memory exceeds what is free")
    return p


def _length(text: str) -> int:
    try:
        return parse_length(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _budget(text: str):
    try:
        return parse_budget(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _families(text: str) -> list[str]:
    try:
        return space.parse_families(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    return command.run_main(_main, sys.argv[1:] if argv is None else argv, PROG,
                            interrupted="run the same command again to continue the search from the results file")


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    args.device_map = None
    # every option checked before the model is loaded (seconds to minutes)
    check_options(Options(args.target_length, args.window, args.seed, args.population, args.parents, args.samples,
                          args.span, args.needle_weight, args.guard))
    tok = load_tokenizer(args.model)
    model = load_model(args)
    search(model, tok, args.target_length, out=args.out, budget=args.budget, text_files=args.text_files,
           seed=args.seed, population=args.population, parents=args.parents, samples=args.samples, span=args.span,
           needle_weight=args.needle_weight, guard=args.guard, families=args.families, window=args.window,
           overwrite=args.overwrite, progress=not args.no_progress, make_plot=not args.no_plot,
           memory_check=not args.no_memory_check, identity={"model_type": model.config.model_type,
                                                             "model_files": model_fingerprint(args.model),
                                                             "dtype": args.dtype or "fp32"})
    return 0
