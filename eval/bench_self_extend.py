"""What Self-Extend and Dual Chunk Attention cost: forward time and peak memory of a SmolLM2-shaped model (d=576, 9
query heads, 3 KV heads, head_dim 64, RoPE theta 1e5; fewer layers, random weights) at long lengths, unpatched (sdpa)
vs position="self-extend" and position="dual-chunk" (default chunk_size and local_window: 3/4 and 1/16 of the
trained window), both on their piece paths (log-sum-exp merge of CPU flash-attention pieces), and optionally the
Self-Extend
explicit path (scores written out a block of queries at a time: what gradients, dropout and softcapping use). Each
(variant, length) runs in its own fresh process, so its peak memory is its own; the ratios come from one run.

Also the numerical cost of computing q and k at the two position maps: the attention output for a few query rows
against float64, in fp32 and bf16, for hfpatch's way (rotate the un-rotated q/k once at each map) and for the
alternative it avoids (take the q/k the model rotated at their own positions and rotate them again by the
difference to the grouped positions).

    python -m eval.bench_self_extend                       # L = 4k and 16k, 4 layers, G = 8, W = 1024
    python -m eval.bench_self_extend --lengths 4096 --repeats 1 --explicit-lengths 4096

With --skipping instead: forwards at position ids that skip, as PoSE training and `hfpatch search`'s proxy samples
give them (--skip-length tokens in equal segments spread evenly over --skip-span positions; 1 segment: contiguous),
the piece path vs the written-out path vs the unpatched model, in fp32 and bf16, timed side by side in one process
(interleaved rounds, so that a busy neighbour slows each alike), with how far the piece path's output is from the
written-out path's:

    python -m eval.bench_self_extend --skipping --json eval/results/self_extend/skipping.json
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

import hfpatch
from eval.benchutil import (
    interleaved,
    length_list,
    markdown_table,
    median,
    module_name,
    parse_or_work,
    timed_forwards,
    worker_grid,
)
from hfpatch.position.attention import paths
from hfpatch.position.schemes import self_extend
from hfpatch.position.schemes.self_extend import _pieces, grouped_key_positions, grouped_query_positions
from hfpatch.utils.files import write_json

GB = 1024**3
THETA = 1e5
MODULE = module_name(__file__)  # what the workers run as


def config(layers, window):
    return LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
                       num_key_value_heads=3, vocab_size=1000, max_position_embeddings=window,
                       rope_parameters={"rope_type": "default", "rope_theta": THETA})


def worker(args):
    torch.manual_seed(0)
    model = LlamaForCausalLM(config(args.layers, args.trained)).eval()
    if args.worker == "dual-chunk":
        hfpatch.patch(model, position="dual-chunk")
    elif args.worker != "unpatched":
        hfpatch.patch(model, position="self-extend", group_size=args.group_size, window=args.window)
    if args.worker == "explicit":  # the path the sdpa name takes for gradients, dropout or softcapping
        model.config._attn_implementation_internal = "hfpatch_self_extend_explicit"

        def explicit(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
            maps = getattr(module, self_extend.STATE_ATTR)
            q_pos, k_pos = self_extend.positions(query, key, kwargs.get("position_ids"), attention_mask)
            qn, kn, qg, kg = maps.rotate(query, key, q_pos, k_pos)
            return self_extend._explicit(maps, q_pos, k_pos, qn, kn, qg, kg, value, attention_mask, scaling, 0.0,
                                         False, None, block=True)

        AttentionInterface.register("hfpatch_self_extend_explicit", explicit)
        AttentionMaskInterface.register("hfpatch_self_extend_explicit", sdpa_mask)
    return timed_forwards(model, args.length, args.repeats)


def accuracy(lengths, group_size, window, rows=8):
    """Max abs error of the Self-Extend attention output (a few query rows, all their keys) against float64, with
    q/k rotated once at each map (hfpatch) or rotated at their own positions and then again by the difference
    (re-rotation), in fp32 and bf16. The pieces path does the attention in both cases."""
    rotary = LlamaRotaryEmbedding(config(1, window))
    d = 64

    def rotate(x, pos):
        cos, sin = rotary(x if x.dtype != torch.float64 else x.float(), pos)
        if x.dtype == torch.float64:  # float64 cos/sin from the definition, for the reference
            inv = 1.0 / THETA ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
            angle = pos[..., None].double() * inv
            cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
        return apply_rotary_pos_emb(x, x[:, :1], cos, sin)[0]

    out = {}
    for L in lengths:
        g = torch.Generator().manual_seed(L)
        q, k, v = (torch.randn(1, h, L, d, generator=g, dtype=torch.float64) for h in (9, 3, 3))
        pos = torch.arange(L)[None]
        qg_pos, kg_pos = grouped_query_positions(pos, group_size, window), grouped_key_positions(pos, group_size)
        picked = torch.linspace(0, L - 1, rows).long()
        qg_ref, kg_ref = rotate(q, qg_pos), rotate(k, kg_pos)
        ref = _reference(rotate(q, pos), rotate(k, pos), qg_ref, kg_ref, v, picked, window)
        for dtype in (torch.float32, torch.bfloat16):
            x = {n: t.to(dtype) for n, t in (("q", q), ("k", k), ("v", v))}
            qn, kn = rotate(x["q"], pos), rotate(x["k"], pos)
            ways = {"once": (rotate(x["q"], qg_pos), rotate(x["k"], kg_pos)),
                    "re-rotated": (rotate(qn, qg_pos - pos), rotate(kn, kg_pos - pos))}
            for way, (qg, kg) in ways.items():
                with torch.no_grad():
                    got = _pieces(qn, kn, qg, kg, x["v"], None, window, d ** -0.5)[:, :, picked]
                name = f"{way}/{str(dtype).replace('torch.', '')}@{L}"
                out[name] = (got.double() - ref).abs().max().item()
                out["qk " + name] = max((a.double() - b).abs().max().item() / b.abs().max().item()
                                        for a, b in ((qg, qg_ref), (kg, kg_ref)))
    return out


def _reference(qn, kn, qg, kg, v, rows, window):
    groups = qn.shape[1] // kn.shape[1]
    kn, kg, v = (t.repeat_interleave(groups, 1) for t in (kn, kg, v))
    i, j = rows[:, None], torch.arange(kn.shape[2])[None]
    s = torch.where(i - j < window, qn[:, :, rows] @ kn.transpose(-1, -2), qg[:, :, rows] @ kg.transpose(-1, -2))
    s = (s * qn.shape[-1] ** -0.5).masked_fill(j > i, float("-inf"))
    return torch.softmax(s, -1) @ v


def skipping_positions(length: int, span: int, segments: int) -> torch.Tensor:
    """[1, length] position ids: `segments` runs of consecutive positions (the last takes what does not divide),
    their starts spread evenly over 0 .. span - 1, as `hfpatch search` spreads a proxy sample's segments."""
    seg = length // segments
    last = length - seg * (segments - 1)
    starts = [round(j * (span - last) / (segments - 1)) for j in range(segments)] if segments > 1 else [0]
    return torch.cat([torch.arange(s, s + (last if j == segments - 1 else seg)) for j, s in enumerate(starts)])[None]


SKIP_VARIANTS = ("unpatched", "pieces", "written-out")


def skipping(args) -> dict:
    """{"dtype/segments": {"seconds": {variant: [per forward]}, "ran": calls per path, "error": max |pieces -
    written-out| / max |written-out| of the last hidden state}}: one model, unpatched and patched, in one process."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = LlamaForCausalLM(config(args.layers, args.trained)).eval()
    patched = hfpatch.patch(copy.deepcopy(base), position="self-extend", group_size=args.group_size,
                            window=args.window)
    ids = torch.randint(0, 1000, (1, args.skip_length), generator=torch.Generator().manual_seed(1))
    out = {}
    for dtype in args.dtypes:
        base.to(getattr(torch, dtype))
        patched.to(getattr(torch, dtype))
        for n in args.segments:
            pos = skipping_positions(args.skip_length, args.skip_span, n)

            def forward(variant: str, pos: torch.Tensor = pos) -> torch.Tensor:
                if variant == "unpatched":
                    return base.model(ids, position_ids=pos).last_hidden_state
                with paths.forcing("self-extend", variant):  # raises if the path cannot take the call
                    return patched.model(ids, position_ids=pos).last_hidden_state

            paths.reset(patched)
            with torch.no_grad():
                first = {v: forward(v) for v in SKIP_VARIANTS}  # the warm-up round, kept for the error
                seconds = interleaved({v: lambda v=v: forward(v) for v in SKIP_VARIANTS}, args.repeats, warmup=0)
            want = first["written-out"].float()
            error = ((first["pieces"].float() - want).abs().max() / want.abs().max()).item()
            out[f"{dtype}/{n}"] = {"seconds": seconds, "ran": paths.ran(patched), "error": error}
            print(dtype, n, {v: round(median(t), 2) for v, t in seconds.items()}, flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=length_list, default=[4096, 16384])
    p.add_argument("--explicit-lengths", type=length_list, default=[4096],
                   help="lengths for the explicit (blocked) path as well")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--trained", type=int, default=8192, help="the model's trained window (max_position_embeddings)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--skipping", action="store_true",
                   help="instead: position ids that skip, piece path vs written-out vs unpatched, in one process")
    p.add_argument("--skip-length", type=int, default=4096, help="--skipping: tokens per forward")
    p.add_argument("--skip-span", type=int, default=16384, help="--skipping: the positions they are spread over")
    p.add_argument("--segments", type=lambda t: [int(x) for x in t.split(",")], default=[1, 4, 16, 64],
                   help="--skipping: segment counts, comma-separated (1: contiguous positions)")
    p.add_argument("--dtypes", type=lambda t: t.split(","), default=["float32", "bfloat16"], help="--skipping")
    p.add_argument("--threads", type=int, default=1, help="--skipping: torch threads")
    args = parse_or_work(p, argv, worker, ["unpatched", "self-extend", "dual-chunk", "explicit"])
    if args is None:
        return
    if args.skipping:
        result = {"args": vars(args), "results": skipping(args)}
        print(skipping_tables(result))
        if args.json:
            write_json(Path(args.json), result)
        return

    shape = ["--layers", str(args.layers), "--group-size", str(args.group_size), "--window", str(args.window),
             "--trained", str(args.trained), "--repeats", str(args.repeats)]
    explicit = lambda L: ["explicit"] if L in args.explicit_lengths else []
    results = worker_grid(MODULE, args.lengths, lambda L: ["unpatched", "self-extend", "dual-chunk", *explicit(L)],
                          shape)
    acc = accuracy(args.lengths, args.group_size, args.window)
    result = {"args": vars(args), "accuracy": acc, "results": {f"{v}@{L}": r for (v, L), r in results.items()}}
    print(tables(result))
    if args.json:
        write_json(Path(args.json), result)


def tables(result: dict) -> str:
    """The two Markdown tables of a run (the --json form: also what eval/docs_tables.py renders)."""
    args, acc, results = result["args"], result["accuracy"], result["results"]

    def t(v, L):
        return median(results[f"{v}@{L}"]["seconds"])

    def mem(v, L):
        return results[f"{v}@{L}"]["peak"]

    rows = []
    for key, r in results.items():
        v, L = key.rsplit("@", 1)
        rows.append([L, v, f"{t(v, L):.2f}", f"{mem(v, L) / GB:.2f}", f"{(mem(v, L) - r['base']) / GB:.2f}",
                     f"{t(v, L) / t('unpatched', L):.2f}", f"{mem(v, L) / mem('unpatched', L):.2f}"])
    lengths = args["lengths"]
    return "\n".join([
        f"SmolLM2-shaped Llama (d=576, 9/3 heads, head_dim 64), {args['layers']} layers, random weights; "
        f"self-extend G={args['group_size']}, W={args['window']}; dual-chunk chunk_size="
        f"{args['trained'] * 3 // 4}, local_window={args['trained'] // 16} (the defaults); forward of the base model, "
        f"batch 1, median of {args['repeats']}; peak = process peak RSS during the forwards",
        markdown_table(["L", "variant", "forward (s)", "peak RSS (GB)", "peak above steady state (GB)",
                        "time / unpatched", "peak / unpatched"], rows),
        "\nAgainst float64: the Self-Extend attention output (max abs error, 8 query rows, all their keys) and the "
        "grouped q/k (max abs error / max abs value):",
        markdown_table(["q/k at the grouped positions", "dtype", *[f"output {L}" for L in lengths],
                        *[f"q/k {L}" for L in lengths]],
                       [[way, dt, *[f"{acc[f'{way}/{dt}@{L}']:.1e}" for L in lengths],
                         *[f"{acc[f'qk {way}/{dt}@{L}']:.1e}" for L in lengths]]
                        for way in ("once", "re-rotated") for dt in ("float32", "bfloat16")])])


def skipping_tables(result: dict) -> str:
    """The Markdown table of a --skipping run (its --json form: also what eval/docs_tables.py renders)."""
    args, results = result["args"], result["results"]
    rows = []
    for key, r in results.items():
        dtype, n = key.split("/")
        t = {v: median(r["seconds"][v]) for v in SKIP_VARIANTS}
        rows.append([dtype, "1 (contiguous)" if n == "1" else n, *(f"{t[v]:.2f}" for v in SKIP_VARIANTS),
                     f"{t['pieces'] / t['unpatched']:.2f}", f"{t['written-out'] / t['unpatched']:.2f}",
                     f"{t['written-out'] / t['pieces']:.1f}", f"{r['error']:.1e}"])
    return "\n".join([
        f"SmolLM2-shaped Llama (d=576, 9/3 heads, head_dim 64), {args['layers']} layers, random weights; self-extend "
        f"G={args['group_size']}, W={args['window']}; forward of the base model, batch 1, {args['skip_length']} "
        f"tokens at positions in equal segments spread over 0..{args['skip_span'] - 1}; {args['threads']} "
        f"thread(s); median of {args['repeats']} interleaved rounds",
        markdown_table(["dtype", "segments", "unpatched (s)", "pieces (s)", "written-out (s)", "pieces / unpatched",
                        "written-out / unpatched", "written-out / pieces",
                        "max abs diff pieces vs written-out (rel.)"], rows)])


if __name__ == "__main__":
    main()
