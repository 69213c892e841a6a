"""Perplexity at a list of lengths x a list of patch specs, on one loaded model.

    hfpatch eval ppl [--model smollm2] [--lengths 2k,8k,16k] [--patches none,yarn:2] [--text-files F ...]
                     [--dataset NAME --config C --split S --text-field F] [--windowing chunks|sliding|both]
                     [--stride 512] [--max-docs 1] [--tokens-per-doc N] [--out runs/ppl]

What is scored: the first `--tokens-per-doc` tokens (default: the longest length) of each of the first
`--max-docs` documents that have that many tokens; shorter documents are skipped and counted. Every cell (patch,
windowing, length) therefore scores the same text, only the context differs:
  chunks   the span cut into non-overlapping windows of `length` tokens, each scored whole (YaRN-paper style);
  sliding  windows of `length` tokens every `--stride` tokens, scoring only tokens not scored before (Press et al.).
ppl = exp(total NLL / scored tokens), pooled over documents; bpb = total NLL / ln 2 / UTF-8 bytes of the scored
tokens (token i owns the text between the end of token i-1 and its own end).

Writes OUT/results.json after every document of every cell (an interrupted run restarted with the same arguments
resumes there), then OUT/table.md (also printed) and OUT/ppl.png.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from pathlib import Path

from . import data
from ..cli import Parser
from .common import (Results, add_model_arguments, applied, check_patches, finite, length_label,
                     load_model, load_tokenizer, now, parse_length, parse_lengths, parse_patches, position_limit,
                     run_main, trained_window, versions)
from .score import causal_lm_parts, document_nll, windows

PROG = "hfpatch eval ppl"
DEFAULT_LENGTHS = "2k,8k,16k"  # the main command: under 10 minutes on 2 CPU cores (see README)


def build_parser(prog: str = PROG) -> Parser:
    p = Parser(prog=prog, description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, help=f"context lengths, k = 1024 (default {DEFAULT_LENGTHS})")
    g = p.add_argument_group("data (default: long source files of the Python standard library)")
    g.add_argument("--text-files", nargs="+", metavar="PATH", help="text files, or folders of .txt files")
    g.add_argument("--dataset", help="a datasets name or local folder (datasets.load_dataset), streamed")
    g.add_argument("--config", help="dataset configuration name")
    g.add_argument("--split", help="dataset split (default test)")
    g.add_argument("--text-field", dest="text_field", help="dataset field holding the text (default text)")
    g.add_argument("--max-docs", type=int, default=1, dest="max_docs",
                   help="score this many documents (the first ones long enough; default 1)")
    g.add_argument("--tokens-per-doc", dest="tokens_per_doc",
                   help="tokens scored per document, from its start (default: the longest length)")
    g.add_argument("--no-cache", action="store_true", help="do not read or write the tokenization cache")
    p.add_argument("--windowing", default="chunks", choices=["chunks", "sliding", "both"])
    p.add_argument("--stride",
                   help="sliding-window stride in tokens (default 512, or half the shortest length if smaller)")
    p.add_argument("--score-chunk", type=int, default=1024, dest="score_chunk",
                   help="positions per LM-head chunk (memory vs overhead; default 1024)")
    p.add_argument("--out", default="runs/ppl", help="folder for results.json, table.md, ppl.png (default runs/ppl)")
    p.add_argument("--overwrite", action="store_true", help="discard an existing results file instead of resuming")
    p.add_argument("--no-plot", action="store_true", dest="no_plot")
    return p


def _settings(args):
    lengths = parse_lengths(args.lengths)
    patches = parse_patches(args.patches)
    span = parse_length(args.tokens_per_doc) if args.tokens_per_doc else max(lengths)
    if span < max(lengths):
        raise ValueError(f"--tokens-per-doc {span} is shorter than the longest length {max(lengths)}")
    windowings = ["chunks", "sliding"] if args.windowing == "both" else [args.windowing]
    stride = None
    if "sliding" in windowings:
        stride = parse_length(args.stride) if args.stride else min(512, min(lengths) // 2)
        if stride >= min(lengths):
            raise ValueError(f"--stride {stride} must be smaller than the shortest length {min(lengths)} "
                             "(a stride of the whole length is --windowing chunks)")
    elif args.stride:
        raise ValueError("--stride applies to --windowing sliding or both")
    if args.max_docs < 1:
        raise ValueError(f"--max-docs must be >= 1, got {args.max_docs}")
    if args.score_chunk < 1:
        raise ValueError(f"--score-chunk must be >= 1, got {args.score_chunk}")
    if not args.dataset and (args.config or args.split or args.text_field):
        raise ValueError("--config, --split and --text-field apply to --dataset")
    if args.dataset and args.text_files:
        raise ValueError("give --text-files or --dataset, not both")
    return lengths, patches, span, windowings, stride


def select_documents(docs, tok, span: int, max_docs: int, use_cache: bool = True):
    """The first `max_docs` documents with at least `span` tokens: [(Document, Tokens)], and the skipped ones."""
    chosen, skipped, longest = [], [], None
    for doc in docs:
        toks = data.tokenize(tok, doc, use_cache)
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


def main(argv=None) -> int:
    return run_main(_main, argv, PROG)


def _main(argv) -> int:
    args = build_parser().parse_args(argv)
    lengths, patches, span, windowings, stride = _settings(args)  # every spec validated before any loading
    source = data.describe_source(args.text_files, args.dataset, args.config, args.split or "test",
                                  args.text_field or "text")
    docs = data.documents(args.text_files, args.dataset, args.config, args.split or "test", args.text_field or "text")
    tok = load_tokenizer(args.model)
    chosen, skipped = select_documents(docs, tok, span, args.max_docs, not args.no_cache)
    if skipped:
        print(f"{PROG}: skipped {len(skipped)} document(s) shorter than {span} tokens", file=sys.stderr)
    if len(chosen) < args.max_docs:
        print(f"{PROG}: only {len(chosen)} document(s) have {span} tokens (--max-docs {args.max_docs})",
              file=sys.stderr)

    corpus_docs = [{"name": d.name, "sha256": d.sha256, "tokens": len(t), "bytes": len(d.text.encode("utf-8"))}
                   for d, t in chosen]
    identity = {"model": args.model, "dtype": args.dtype, "corpus": source, "documents": corpus_docs,
                "tokens_per_doc": span, "stride": stride}
    out = Path(args.out)
    results = Results(out / "results.json", "perplexity", identity, args.overwrite)
    if results.resumed:
        print(f"{PROG}: resuming from {out / 'results.json'}", file=sys.stderr)
    settings = {"lengths": lengths, "patches": [p for p, _ in patches], "windowing": windowings, "stride": stride,
                "tokens_per_doc": span, "max_docs": args.max_docs, "score_chunk": args.score_chunk,
                "dtype": args.dtype, "device_map": args.device_map,
                "argv": list(sys.argv[1:] if argv is None else argv)}
    results.data.update(settings=settings, versions=versions(),
                        corpus={**source, "documents": corpus_docs, "skipped": len(skipped),
                                "skipped_examples": skipped[:20],
                                "byte_attribution": "offsets" if all(t.exact_bytes for _, t in chosen)
                                else "per-token decode (approximate)"})

    todo = [(p, kw, n, w) for p, kw in patches for n in lengths for w in windowings
            if not _is_complete(results, p, w, n)]
    if todo:
        model = load_model(args)
        _prepare(model, patches, lengths, results)
        results.save()
        _run(model, todo, chosen, span, stride, args.score_chunk, results)
    _report(results, [p for p, _ in patches], lengths, windowings, out, not args.no_plot)
    return 0


def _is_complete(results, patch, windowing, length) -> bool:
    return any(c["patch"] == patch and c["windowing"] == windowing and c["length"] == length and c.get("complete")
               for c in results.data["cells"])


def _prepare(model, patches, lengths, results) -> None:
    causal_lm_parts(model)  # a clear error for masked LMs before anything runs
    check_patches(model, patches)
    for name, kwargs in patches:
        with applied(model, kwargs, name):
            limit = position_limit(model)
        if limit and max(lengths) > limit:
            raise ValueError(f"patch {name!r}: the model has learned positions for {limit} tokens only, "
                             f"so length {max(lengths)} cannot run; use lengths <= {limit}")
    from ..apply import unwrap

    target = unwrap(model)
    results.data["model"] = {"name": results.data["identity"]["model"], "class": type(target).__name__,
                             "model_type": target.config.model_type, "trained_window": trained_window(model),
                             "dtype": str(next(target.parameters()).dtype).replace("torch.", ""),
                             "parameters": sum(p.numel() for p in target.parameters())}


def _run(model, todo, chosen, span, stride, score_chunk, results) -> None:
    from tqdm.auto import tqdm

    parts = causal_lm_parts(model)
    plan = []  # (patch, kwargs, length, windowing, [(doc, toks, windows)]); cells are created when reached
    for patch, kwargs, length, w in todo:
        cell = results.find({"patch": patch, "windowing": w, "length": length})
        done = {d["name"] for d in cell["documents"]} if cell else set()
        work = [(doc, toks, windows(span, length, w, stride)) for doc, toks in chosen if doc.name not in done]
        plan.append((patch, kwargs, length, w, work))
    total = sum(sum(e - s for s, e, _ in wins) for *_, work in plan for _, _, wins in work)
    bar = tqdm(total=total, unit="tok", unit_scale=True, desc="perplexity", file=sys.stderr, dynamic_ncols=True)

    class _Tokens:  # document_nll reports windows; the bar counts the tokens the model reads
        def __init__(self, wins):
            self.sizes = iter([e - s for s, e, _ in wins])

        def update(self, _):
            bar.update(next(self.sizes))

    try:
        for patch, group in itertools.groupby(plan, key=lambda item: item[0]):
            group = list(group)
            with applied(model, group[0][1], patch):  # patch once per spec, not per cell
                for _, kwargs, length, w, work in group:
                    bar.set_postfix_str(f"{patch} {w} {length_label(length)}")
                    cell = results.cell({"patch": patch, "windowing": w, "length": length},
                                        lambda: {"patch": patch, "windowing": w, "length": length,
                                                 "stride": stride if w == "sliding" else None, "patch_kwargs": kwargs,
                                                 "documents": [], "complete": False})
                    for doc, toks, wins in work:
                        t0 = time.perf_counter()
                        nll, n, runs = document_nll(parts, toks.ids[:span], wins, score_chunk, _Tokens(wins))
                        nbytes = sum(toks.bytes_between(a, b) for a, b in runs)
                        cell["documents"].append({"name": doc.name, "tokens": n, "nll_sum": nll, "bytes": nbytes,
                                                  "windows": len(wins), "seconds": round(time.perf_counter() - t0, 3)})
                        results.save()
                    _finish(cell)
                    results.save()
    finally:
        bar.close()


def _finish(cell) -> None:
    docs = cell["documents"]
    nll, n, nbytes = sum(d["nll_sum"] for d in docs), sum(d["tokens"] for d in docs), sum(d["bytes"] for d in docs)
    mean = nll / n
    cell.update(nll_sum=nll, tokens=n, bytes=nbytes, mean_nll=mean,
                ppl=finite(math.exp(mean) if mean < 700 else math.inf),
                bpb=nll / math.log(2) / nbytes if nbytes else None,
                seconds=round(sum(d["seconds"] for d in docs), 3), complete=True, finished=now())


def _report(results, patches, lengths, windowings, out: Path, plot: bool) -> None:
    from . import report

    cells = results.data["cells"]
    model = results.data.get("model", {})
    docs = results.data["corpus"]["documents"]
    src = results.data["corpus"]
    src_name = {"stdlib": "Python stdlib sources", "files": "text files",
                "dataset": f"dataset {src.get('name')}"}[src["kind"]]
    caption = (f"{model.get('name', results.data['identity']['model'])}: {len(docs)} document(s) of {src_name}, "
               f"{results.data['identity']['tokens_per_doc']} tokens each")
    text = f"{caption}\n\n" + report.ppl_tables(cells, patches, lengths, windowings)
    (out / "table.md").write_text(text + "\n")
    print(text)
    if plot:
        report.ppl_plot(cells, patches, lengths, windowings, out / "ppl.png", title=caption,
                        trained_window=model.get("trained_window"))
        print(f"\nplot: {out / 'ppl.png'}; results: {out / 'results.json'}", file=sys.stderr)
