"""What ALiBi costs: forward time and peak memory of a small Llama at long lengths, unpatched (RoPE, sdpa) vs
hfpatch's ALiBi vs a naive ALiBi that hands sdpa the full [1, heads, L, L] bias. Each (variant, length) runs in its
own fresh process, so peak memory is its own. Also the accuracy of the factorised attention against a float64
computation of the same attention.

    python -m eval.bench_alibi                                   # L = 2k, 8k, 16k; naive up to 8k
    python -m eval.bench_alibi --lengths 2048,8192 --naive-lengths 2048 --repeats 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import hfpatch
from eval.benchutil import length_list, markdown_table, median, module_name, timed_forwards, worker_grid
from hfpatch.position.schemes.alibi import SLOPES_ATTR, alibi_bias, alibi_slopes, factorise
from hfpatch.utils.files import write_json

GB = 1024**3
NAIVE = "bench_alibi_full_bias"
MODULE = module_name(__file__)  # what the workers run as

def naive_full_bias(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """ALiBi as a materialized [1, H, q, kv] float bias (causal -inf included) passed to sdpa."""
    q_len, kv_len = query.shape[2], key.shape[2]
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    k_pos = torch.arange(kv_len)
    q_pos = torch.arange(kv_len - q_len, kv_len)
    bias = alibi_bias(getattr(module, SLOPES_ATTR), q_pos, k_pos, bidirectional=False).to(query.dtype)
    bias = bias.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))[None]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def worker(args):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.heads, vocab_size=1000,
                         max_position_embeddings=args.length)
    model = LlamaForCausalLM(config).eval()
    if args.worker != "unpatched":
        hfpatch.patch(model, position="alibi")
    if args.worker == "naive":
        AttentionInterface.register(NAIVE, naive_full_bias)
        AttentionMaskInterface.register(NAIVE, sdpa_mask)
        model.config._attn_implementation_internal = NAIVE
    return timed_forwards(model, args.length, args.repeats)


def accuracy(lengths, heads=8, dim=32):
    """Max abs error of the factorised ALiBi attention (fp32, as run) against float64, on a few query rows."""
    out = {}
    slopes = torch.tensor(alibi_slopes(heads))
    for L in lengths:
        g = torch.Generator().manual_seed(L)
        q, k, v = (torch.randn(1, heads, L, dim, generator=g) for _ in range(3))
        scale = dim ** -0.5
        qa, ka, va = factorise(slopes, q, k, v, scale, centre=L - (L + 1) // 2)
        fast = F.scaled_dot_product_attention(qa, ka, va, is_causal=True, scale=scale)[..., :dim]
        rows = torch.tensor([0, 1, L // 2, L - 2, L - 1])
        scores = (q[:, :, rows].double() @ k.double().transpose(-1, -2)) * scale
        scores = scores + alibi_bias(slopes.double(), rows, torch.arange(L), False)[None]
        scores = scores.masked_fill(torch.arange(L)[None, :] > rows[:, None], float("-inf"))
        ref = torch.softmax(scores, -1) @ v.double()
        out[L] = (fast[:, :, rows].double() - ref).abs().max().item()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=length_list, default=[2048, 8192, 16384])
    p.add_argument("--naive-lengths", type=length_list, default=[2048, 8192],
                   help="lengths for the naive full-bias variant (it needs ~18 GB at 16k)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--worker", choices=["unpatched", "alibi", "naive"], help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return

    shape = ["--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
             "--repeats", str(args.repeats)]
    results = worker_grid(MODULE, args.lengths,
                          lambda L: ["unpatched", "alibi"] + (["naive"] if L in args.naive_lengths else []), shape)
    acc = accuracy(args.lengths)

    def t(v, L):
        return median(results[(v, L)]["seconds"])

    def mem(v, L):
        return results[(v, L)]["peak"]

    def act(v, L):
        return results[(v, L)]["peak"] - results[(v, L)]["base"]

    rows = []
    for L in args.lengths:
        for v in ("unpatched", "alibi", "naive"):
            if (v, L) not in results:
                continue
            rows.append([L, v, f"{t(v, L):.2f}", f"{mem(v, L) / GB:.2f}", f"{act(v, L) / GB:.2f}",
                         f"{t(v, L) / t('unpatched', L):.2f}", f"{mem(v, L) / mem('unpatched', L):.2f}",
                         f"{acc[L]:.1e}" if v == "alibi" else ""])
    print(f"Llama, {args.layers} layers, d={args.hidden}, {args.heads} heads; forward of the base model, batch 1, "
          f"median of {args.repeats}; peak = process peak RSS during the forwards")
    print(markdown_table(["L", "variant", "forward (s)", "peak RSS (GB)", "peak above steady state (GB)",
                          "time / unpatched", "peak / unpatched", "attention max abs err (fp32 vs fp64)"], rows))
    if args.json:
        write_json(Path(args.json), {"args": vars(args), "accuracy": acc,
                                     "results": {f"{v}@{L}": r for (v, L), r in results.items()}})


if __name__ == "__main__":
    main()
