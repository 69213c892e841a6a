"""Training steps (forward, loss, backward) of Dual Chunk Attention, T5 and Transformer-XL on the paths that keep no
[length, length] tensor for the backward pass, against their written-out path and the unpatched model (sdpa): time
and peak memory, each cell in a fresh process of its own (its peak RSS is its own), the ratios from one run.

    python -m eval.bench_training_paths                       # L = 4096, 2 layers, one thread: a few minutes
    python -m eval.bench_training_paths --lengths 2048,4096 --repeats 2

The model is bench_attention's SmolLM2-shaped Llama (d=576, 9/3 heads, head_dim 64, random weights) with 2 layers;
Dual Chunk Attention with chunks of 1,792 positions (chunk_size 2048, local_window 256), so that 4k tokens cross
two chunk boundaries; T5 with 32 buckets, its table given random values; XL's parameters too. Transformer-XL's CPU
training path is `widened` (one sdpa call on widened queries and keys); its `recomputed` path (the one CUDA takes)
is measured here as well. Writes OUT/bench.json and OUT/bench.md (OUT = eval/results/training_paths).
"""

from __future__ import annotations

import argparse

import torch

from eval import bench_attention
from eval.benchutil import REPO, length_list, markdown_table, median, module_name, parse_or_work, run_cells
from hfpatch.position.attention import paths

GB = 1024**3
MODULE = module_name(__file__)
OPTIONS = {"dual-chunk": {"chunk_size": 2048, "local_window": 256}, "t5": {}, "xl": {}}
# scheme -> the paths measured, the new one(s) first
CELLS = {"dual-chunk": ["pieces", "written-out"], "t5": ["pieces", "written-out"],
         "xl": ["widened", "recomputed", "written-out"]}


def build(scheme: str, layers: int, length: int):
    if scheme == "unpatched":
        return bench_attention.build("unpatched", layers, length)
    saved = bench_attention.CHOSEN.get(scheme)
    bench_attention.CHOSEN[scheme] = OPTIONS[scheme]
    try:
        model = bench_attention.build(scheme, layers, length)
    finally:
        if saved is not None:
            bench_attention.CHOSEN[scheme] = saved
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # the scheme's parameters start at zero (XL, T5): give them values, as after training
        for name, p in model.named_parameters():
            if "hfpatch_xl" in name:
                p.normal_(0.0, 0.05, generator=g)
    return model


def worker(args) -> dict:
    """One cell: VARIANT is "unpatched" or "SCHEME/PATH" (the path forced)."""
    torch.set_num_threads(args.threads)
    scheme, _, path = args.worker.partition("/")
    model = build(scheme, args.layers, args.length)
    paths.reset(model)
    if path:
        with paths.forcing(scheme, path):
            out = bench_attention.timed_train(model, args.length, args.repeats)
    else:
        out = bench_attention.timed_train(model, args.length, args.repeats)
    out["ran"] = paths.ran(model)
    return out


def variants() -> list[str]:
    return ["unpatched", *(f"{s}/{p}" for s, ps in CELLS.items() for p in ps)]


def tables(results: dict, args) -> str:
    head = ["L", "scheme/path", "seconds", "time / written-out", "time / unpatched", "peak RSS (GB)",
            "peak above steady state (GB)", "peak above steady / written-out's", "calls per path"]
    rows = []
    for (v, L), r in results.items():
        if "error" in r:
            rows.append([L, v, r["error"], "", "", "", "", "", ""])
            continue
        scheme = v.partition("/")[0]
        wo, base = results.get((f"{scheme}/written-out", L), {}), results.get(("unpatched", L), {})
        t = median(r["seconds"])
        above = r["peak"] - r["base"]

        def ratio(x: float, other: dict, y: float) -> str:
            return f"{x / y:.2f}" if "seconds" in other else ""

        ran = ", ".join(f"{k} x{n}" for k, n in sorted(r["ran"].items())) or "sdpa (the model's own)"
        rows.append([L, v, f"{t:.2f}", ratio(t, wo, median(wo.get("seconds", [1]))),
                     ratio(t, base, median(base.get("seconds", [1]))), f"{r['peak'] / GB:.2f}", f"{above / GB:.2f}",
                     ratio(above, wo, wo.get("peak", 1) - wo.get("base", 0)), ran])
    return "\n".join([
        f"SmolLM2-shaped Llama (d=576, 9/3 heads, head_dim 64), {args.layers} layers, random weights, fp32; batch 1; "
        f"one training step (forward, loss, backward), median of {args.repeats} after a 256-token warm-up; "
        f"{args.threads} thread(s); each cell its own process; peak = process peak RSS during the timed steps, "
        "steady state = RSS before them (the model and its optimizer-free state). Dual Chunk Attention: "
        "chunk_size 2048, local_window 256; T5: 32 buckets.", "",
        markdown_table(head, rows)])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=length_list, default=[4096])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(REPO / "eval" / "results" / "training_paths"))
    args = parse_or_work(p, argv, worker)
    if args is None:
        return
    shape = ["--layers", str(args.layers), "--repeats", str(args.repeats), "--threads", str(args.threads)]
    run_cells(MODULE, [(v, L) for L in args.lengths for v in variants()], shape, args, tables)


if __name__ == "__main__":
    main()
