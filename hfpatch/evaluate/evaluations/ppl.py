"""Perplexity at a list of lengths x a list of patch specs, on one loaded model.

    hfpatch eval ppl [--model smollm2] [--lengths 2k,8k,16k] [--patches none,yarn:2] [--text-files F ...]
                     [--dataset NAME --config C --split S --text-field F] [--windowing chunks|sliding|rolling|both]
                     [--stride 512] [--max-docs N|all] [--tokens-per-doc N|all] [--out runs/ppl]

What is scored. Given text (--text-files, --dataset): everything given — every document with at least the longest
length of tokens, whole (cut to a multiple of the longest length for chunks, so that every length scores the same
tokens). The default corpus (no data named): its first long document, the longest length of tokens (a quick run).
--max-docs and --tokens-per-doc score less. Shorter documents are skipped and counted. Windowing:
  chunks   non-overlapping windows of `length` tokens, each scored whole (YaRN-paper style);
  sliding  windows of `length` tokens every `--stride` tokens, scoring only tokens not scored before (Press et al.);
  rolling  lm-evaluation-harness's rolling loglikelihood: a prefix token (BOS, else EOS) before each document, then
           every token scored once in disjoint runs of `length` predictions (the same numbers as lm-eval's).
ppl = exp(total NLL / scored tokens), pooled over documents; bpb = total NLL / ln 2 / UTF-8 bytes of the scored
tokens (token i owns the text between the end of token i-1 and its own end).

Writes OUT/results.json after every document of every cell (an interrupted run restarted with the same arguments
resumes there), then OUT/table.md (also printed) and OUT/ppl.png. The run-time estimate is printed before scoring.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ...lm import text as texts
from ...lm.windows import windows
from .. import definition, plots, report
from ..parsing import finite, length_label, parse_length, parse_lengths

DEFAULT_LENGTHS = "2k,8k,16k"  # the main command: under 10 minutes on 2 CPU cores (see README)
WINDOWINGS = ("chunks", "sliding", "rolling")


class Perplexity(definition.Evaluation):
    kind = "perplexity"  # what its results files are marked with (files written so far resume under it)
    records = "documents"
    unit_key = "name"
    axes: ClassVar[dict[str, str]] = {"windowing": "windowing", "lengths": "length"}

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--lengths", default=DEFAULT_LENGTHS,
                       help=f"context lengths, k = 1024 (default {DEFAULT_LENGTHS})")
        g = p.add_argument_group("data (default: long source files of the Python standard library)")
        g.add_argument("--text-files", nargs="+", metavar="PATH", help="text files, or folders of .txt files")
        g.add_argument("--dataset", help="a datasets name or local folder (datasets.load_dataset), streamed")
        g.add_argument("--config", help="dataset configuration name")
        g.add_argument("--split", help="dataset split (default test)")
        g.add_argument("--text-field", dest="text_field", help="dataset field holding the text (default text)")
        g.add_argument("--max-docs", dest="max_docs",
                       help="score this many documents, the first ones long enough (default: all of the given "
                            "text; 1 of the default corpus)")
        g.add_argument("--tokens-per-doc", dest="tokens_per_doc",
                       help="tokens scored per document, from its start (default: whole documents of the given "
                            "text; the longest length of the default corpus)")
        g.add_argument("--no-cache", action="store_true", help="do not read or write the tokenization cache")
        p.add_argument("--windowing", default="chunks",
                       help="chunks, sliding, rolling, or several comma-separated (both = chunks,sliding; "
                            "default chunks)")
        p.add_argument("--stride",
                       help="sliding-window stride in tokens (default 512, or half the shortest length if smaller)")
        p.add_argument("--score-chunk", type=int, default=1024, dest="score_chunk",
                       help="positions per LM-head chunk (memory vs overhead; default 1024)")

    def plan(self, args: argparse.Namespace, tok: Any) -> definition.Plan:
        lengths = parse_lengths(args.lengths)
        longest = max(lengths)
        windowings, stride = _windowings_and_stride(args, lengths)
        _check_text_options(args)
        given = bool(args.text_files or args.dataset)  # the user named text: score all of it by default
        max_docs = _count(args.max_docs, "--max-docs", default=None if given else 1)
        per_doc = _count(args.tokens_per_doc, "--tokens-per-doc", default=None if given else longest, parse=True)
        if per_doc is not None and per_doc < longest:
            raise ValueError(f"--tokens-per-doc {per_doc} is shorter than the longest length {longest}")

        split, field = args.split or "test", args.text_field or "text"
        source = texts.describe_source(args.text_files, args.dataset, args.config, split, field)
        docs = texts.documents(args.text_files, args.dataset, args.config, split, field)
        chosen, skipped = select_documents(docs, tok, per_doc or longest, max_docs, not args.no_cache)
        if skipped:
            print(f"{self.prog}: skipped {len(skipped)} document(s) shorter than {per_doc or longest} tokens",
                  file=sys.stderr)
        if max_docs and len(chosen) < max_docs:
            print(f"{self.prog}: only {len(chosen)} document(s) have {per_doc or longest} tokens "
                  f"(--max-docs {max_docs})", file=sys.stderr)
        prefix = _prefix_token(tok) if "rolling" in windowings else None

        cells = _cells(windowings, lengths, chosen, per_doc, stride, prefix)
        corpus_docs = [{"name": d.name, "sha256": d.sha256, "tokens": len(t), "bytes": len(d.text.encode("utf-8"))}
                       for d, t in chosen]
        identity = {"model": args.model, "dtype": args.dtype, "corpus": source, "documents": corpus_docs,
                    "tokens_per_doc": per_doc or "all", "stride": stride, "prefix_token": prefix}
        settings = {"lengths": lengths, "windowing": windowings, "stride": stride,
                    "tokens_per_doc": per_doc or "all", "max_docs": max_docs or "all",
                    "score_chunk": args.score_chunk, "dtype": args.dtype, "device_map": args.device_map}
        corpus = {**source, "documents": corpus_docs, "skipped": len(skipped), "skipped_examples": skipped[:20],
                  "byte_attribution": "offsets" if all(t.exact_bytes for _, t in chosen)
                  else "per-token decode (approximate)"}
        return definition.Plan(identity, cells, read=longest, score_chunk=args.score_chunk,
                          info={"settings": settings, "corpus": corpus})

    def run_unit(self, run: Any, cell: dict, unit: Any, progress: Any) -> dict:
        toks, ids, wins, shift = unit.data
        nll, n, scored = run.document_nll(ids, wins, run.args.score_chunk, progress)
        # bytes of the scored tokens; with a prefix token (rolling), ids[i] is the document's token i - 1
        nbytes = sum(toks.bytes_between(a - shift, b - shift) for a, b in scored)
        return {"tokens": n, "nll_sum": nll, "bytes": nbytes, "windows": len(wins)}

    def summarize(self, records: list[dict]) -> dict:
        # a document's NaN loss is stored as null: it keeps the cell's loss NaN when the cell is checked on resume
        nll = sum(math.nan if r["nll_sum"] is None else r["nll_sum"] for r in records)
        n, nbytes = (sum(r[k] for r in records) for k in ("tokens", "bytes"))
        mean = nll / n
        return {"nll_sum": nll, "tokens": n, "bytes": nbytes, "mean_nll": mean,
                "ppl": finite(math.exp(mean) if mean < 700 else math.inf),
                "bpb": nll / math.log(2) / nbytes if nbytes else None,
                "seconds": round(sum(r["seconds"] for r in records), 3)}

    def caption(self, data: dict) -> str:
        model = data.get("model", {})
        src = data["corpus"]
        src_name = {"stdlib": "Python stdlib sources", "files": "text files",
                    "dataset": f"dataset {src.get('name')}"}[src["kind"]]
        per_doc = data["identity"]["tokens_per_doc"]
        total = sum(d["tokens"] for d in src["documents"])
        each = f"{per_doc} tokens each" if per_doc != "all" else f"whole documents ({total:,} tokens)"
        name = model.get("name", data["identity"]["model"])
        return f"{name}: {len(src['documents'])} document(s) of {src_name}, {each}"

    def tables(self, data: dict) -> str:
        """One table per windowing and measure: rows = patch spec, columns = length."""
        cells, settings = data["cells"], data["settings"]
        done = {(c["patch"], c["windowing"], c["length"]): c for c in report.complete(cells)}
        out = []
        for w in settings["windowing"]:
            for measure, title, digits in (("ppl", "perplexity", 2), ("bpb", "bits per byte", 3)):
                header = ["patch"] + [length_label(n) for n in settings["lengths"]]
                rows = []
                for p in settings["patches"]:
                    cs = [done.get((p, w, n)) for n in settings["lengths"]]
                    rows.append([p] + ["—" if c is None else _shown(c, measure, digits) for c in cs])
                stride = next((c.get("stride") for c in cells if c["windowing"] == w and c.get("stride")), None)
                label = f"{w}, stride {stride}" if w == "sliding" else w
                out.append(f"**{title}** ({label})\n\n" + report.markdown_table(header, rows))
        return "\n\n".join(out)

    def plot(self, data: dict, path: Path | str, title: str) -> None:
        """Perplexity vs length, one line per patch spec (solid: chunks, dashed: sliding), log-log axes."""
        settings, window = data["settings"], data.get("model", {}).get("trained_window")
        lengths, windowings = settings["lengths"], settings["windowing"]
        done = {(c["patch"], c["windowing"], c["length"]): c for c in report.complete(data["cells"])}
        fig = plots.figure(figsize=(7, 4.5))
        ax = fig.subplots()
        colors = plots.colors()
        plotted: list[float] = []  # the perplexities drawn, for the value axis
        for i, p in enumerate(settings["patches"]):
            for w in windowings:
                pts = [(n, done[(p, w, n)]["ppl"]) for n in lengths if (p, w, n) in done and done[(p, w, n)]["ppl"]]
                if not pts:
                    continue
                plotted += [y for _, y in pts]
                label = p if len(windowings) == 1 else f"{p} ({w})"
                ax.plot(*zip(*pts), marker="o", color=colors[i % len(colors)],
                        linestyle="-" if w == "chunks" else "--", label=label)
        if plots.shows_window(window, lengths):
            ax.axvline(window, color="gray", linestyle=":", linewidth=1)
            ax.text(window, 0.98, " trained window", transform=ax.get_xaxis_transform(), color="gray",
                    fontsize=8, va="top")
        plots.length_axis(ax, lengths)
        if plotted:  # labels across the perplexities drawn, not only at the powers of ten
            plots.log_value_axis(ax, plotted)
        else:
            ax.set_yscale("log")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("perplexity (log scale)")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)


def _windowings_and_stride(args: argparse.Namespace, lengths: list[int]) -> tuple[list[str], int | None]:
    """The windowings asked for (in WINDOWINGS' order) and the sliding stride (None without sliding), checked."""
    names = ["chunks", "sliding"] if args.windowing == "both" else [w.strip() for w in args.windowing.split(",")]
    if not names or any(w not in WINDOWINGS for w in names) or len(set(names)) != len(names):
        raise ValueError(f"--windowing {args.windowing!r}: expected chunks, sliding, rolling, or several of "
                         "them comma-separated (both = chunks,sliding)")
    windowings = [w for w in WINDOWINGS if w in names]
    stride = None
    if "sliding" in windowings:
        stride = parse_length(args.stride) if args.stride else min(512, min(lengths) // 2)
        if stride >= min(lengths):
            raise ValueError(f"--stride {stride} must be smaller than the shortest length {min(lengths)} "
                             "(a stride of the whole length is --windowing chunks)")
    elif args.stride:
        raise ValueError("--stride applies to --windowing sliding or both")
    return windowings, stride


def _check_text_options(args: argparse.Namespace) -> None:
    """The scoring chunk and the options that say where the text comes from, as they go together."""
    if args.score_chunk < 1:
        raise ValueError(f"--score-chunk must be >= 1, got {args.score_chunk}")
    if not args.dataset and (args.config or args.split or args.text_field):
        raise ValueError("--config, --split and --text-field apply to --dataset")
    if args.dataset and args.text_files:
        raise ValueError("give --text-files or --dataset, not both")


def _cells(windowings: list[str], lengths: list[int], chosen: list, per_doc: int | None, stride: int | None,
           prefix: int | None) -> list[definition.Cell]:
    """A cell per (windowing, length), a unit per document: the windows it scores and what scoring them needs."""
    longest = max(lengths)
    cells = []
    for w in windowings:
        for n in lengths:
            units = []
            for doc, toks in chosen:
                span = per_doc or (len(toks) // longest * longest if w == "chunks" else len(toks))
                ids = toks.ids[:span]
                if w == "rolling":
                    ids = np.concatenate([[prefix], ids]).astype(np.int64)
                wins = windows(len(ids), n, w, stride)
                units.append(definition.Unit(doc.name, [(e - s - 1, e - s - 1, e - s - f) for s, e, f in wins],
                                        (toks, ids, wins, 1 if w == "rolling" else 0)))
            cells.append(definition.Cell({"windowing": w, "length": n}, units,
                                    {"stride": stride if w == "sliding" else None,
                                     "prefix_token": prefix if w == "rolling" else None}))
    return cells


def _shown(cell: dict, measure: str, digits: int) -> str:
    """A cell's perplexity or bits per byte in a table: "nan" where the loss is not a number (its mean NLL is null
    too), else report.number ("inf" for a perplexity that overflowed: its mean NLL is finite)."""
    if cell[measure] is None and cell.get("mean_nll") is None:
        return "nan"
    return report.number(cell[measure], digits)


def _count(text: str, flag: str, default: Any, parse: bool = False) -> Any:
    """--max-docs / --tokens-per-doc: a positive number, or 'all' (None)."""
    if text is None:
        return default
    if text.strip().lower() == "all":
        return None
    try:
        value = parse_length(text) if parse else int(text)
    except ValueError:
        raise ValueError(f"{flag} must be a positive number or 'all', got {text!r}") from None
    if value < 1:
        raise ValueError(f"{flag} must be >= 1, got {value}")
    return value


def _prefix_token(tok: Any) -> int:
    """The token lm-evaluation-harness puts before a document for its rolling loglikelihood: BOS, else EOS."""
    for t in (tok.bos_token_id, tok.eos_token_id):
        if t is not None:
            return int(t)
    raise ValueError("--windowing rolling needs a BOS or EOS token to start each document; this tokenizer has neither")


def select_documents(docs: Any, tok: Any, span: int, max_docs: int | None, use_cache: bool = True) -> tuple[list, list]:
    """The first `max_docs` (None: all) documents with at least `span` tokens: [(Document, Tokens)], and the
    skipped ones."""
    chosen, skipped, longest = [], [], None
    for doc in docs:
        toks = texts.tokenize(tok, doc, use_cache)
        if longest is None or len(toks) > longest[1]:
            longest = (doc.name, len(toks))
        if len(toks) < span:
            skipped.append({"name": doc.name, "tokens": len(toks)})
            continue
        chosen.append((doc, toks))
        if len(chosen) == max_docs:
            break
    if not chosen:
        where = f" (the longest has {longest[1]}: {longest[0]})" if longest else " (the corpus is empty)"
        raise ValueError(f"no document has {span} tokens, the longest length or --tokens-per-doc{where}; "
                         "use shorter --lengths or longer texts")
    return chosen, skipped


EVALUATION = Perplexity()
main = EVALUATION.main
