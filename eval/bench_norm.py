"""LayerNorm vs RMSNorm, measured: forward+backward time and peak memory of a GPT-2-small-sized model with its
LayerNorms, and of the same model after hfpatch's exact LayerNorm -> RMSNorm conversion; plus what the conversion
itself costs (time, peak and retained memory).

Every variant runs in its own fresh process (peak memory is per process); rounds alternate the order.

    python -m eval.bench_norm                         # 12 layers, d=768, 12 heads, batch 1 x 1024 tokens
    python -m eval.bench_norm --seq 2048 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hfpatch
from eval.benchutil import int_options, median, module_name, passed_on, peak_rss, reset_peak_rss, rss, run_worker
from hfpatch.evaluate.report import markdown_table
from hfpatch.utils.files import write_json

GB = 1024**3
MODULE = module_name(__file__)  # what the workers run as


def _config(args):
    return GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, n_positions=max(1024, args.seq),
                      vocab_size=args.vocab)


def prepare(args, folder):
    """Save the LayerNorm model and its exact RMSNorm conversion (so the timing workers load plain checkpoints and
    carry no undo log)."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(_config(args))
    with torch.no_grad():  # non-trivial norms, so the conversion has something to fold
        for name, p in model.named_parameters():
            if "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(os.path.join(folder, "layernorm"))
    hfpatch.save_pretrained(hfpatch.patch(model, norm="rmsnorm"), os.path.join(folder, "rmsnorm"))
    return {}


def train_steps(args, folder, variant):
    torch.manual_seed(0)
    model = hfpatch.from_pretrained(os.path.join(folder, variant)).train()
    for m in model.modules():  # timing, not regularization
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    loss = model(x, labels=x).loss  # warm-up
    loss.backward()
    model.zero_grad(set_to_none=True)
    base = rss()
    reset_peak_rss()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        loss = model(x, labels=x).loss
        loss.backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return {"seconds": times, "peak": peak_rss(), "base": base, "loss": loss.item(),
            "norm": hfpatch.describe(model)["norm"]["kind"]}


def convert(args, folder):
    model = GPT2LMHeadModel.from_pretrained(os.path.join(folder, "layernorm"))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    before = rss()
    reset_peak_rss()
    t0 = time.perf_counter()
    hfpatch.patch(model, norm="rmsnorm")
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "peak_extra": peak_rss() - before, "retained": rss() - before, "params": params,
            "exact": hfpatch.describe(model)["norm"]["exact"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sizes = int_options(p, layers=12, hidden=768, heads=12, vocab=50257, seq=1024, batch=1)
    p.add_argument("--repeats", type=int, default=3, help="timed steps per worker")
    p.add_argument("--rounds", type=int, default=2, help="workers per variant, in alternating order")
    p.add_argument("--json")
    p.add_argument("--worker", choices=["prepare", "layernorm", "rmsnorm", "convert"], help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        result = {"prepare": lambda: prepare(args, args.folder), "convert": lambda: convert(args, args.folder)}.get(
            args.worker, lambda: train_steps(args, args.folder, args.worker))()
        print(json.dumps(result))
        return result

    shape = passed_on(args, [*sizes, "repeats"])
    with tempfile.TemporaryDirectory() as folder:
        run_worker(MODULE, ["--worker", "prepare", "--folder", folder, *shape])
        runs = {"layernorm": [], "rmsnorm": []}
        for r in range(args.rounds):
            for variant in ("layernorm", "rmsnorm") if r % 2 == 0 else ("rmsnorm", "layernorm"):
                runs[variant].append(run_worker(MODULE, ["--worker", variant, "--folder", folder, *shape]))
        conv = run_worker(MODULE, ["--worker", "convert", "--folder", folder, *shape])
    t = {v: median([s for run in rs for s in run["seconds"]]) for v, rs in runs.items()}
    peak = {v: max(run["peak"] for run in rs) for v, rs in runs.items()}
    act = {v: max(run["peak"] - run["base"] for run in rs) for v, rs in runs.items()}
    loss = {v: rs[0]["loss"] for v, rs in runs.items()}
    print(f"GPT-2 shape: {args.layers} layers, d={args.hidden}, {args.heads} heads, vocab {args.vocab}; "
          f"batch {args.batch} x {args.seq} tokens; forward+backward, median of {args.repeats * args.rounds} steps")
    print(markdown_table(
        ["norm", "fwd+bwd (s)", "peak RSS (GB)", "peak above steady state (GB)", "loss"],
        [[v, f"{t[v]:.3f}", f"{peak[v] / GB:.2f}", f"{act[v] / GB:.2f}", f"{loss[v]:.6f}"] for v in t],
    ))
    print(f"\nratio rmsnorm / layernorm: time {t['rmsnorm'] / t['layernorm']:.3f}, peak RSS "
          f"{peak['rmsnorm'] / peak['layernorm']:.3f}, peak above steady state {act['rmsnorm'] / act['layernorm']:.3f}")
    print(f"exact conversion (patch(norm='rmsnorm')): {conv['seconds']:.2f} s, peak +{conv['peak_extra'] / GB:.2f} GB, "
          f"retained +{conv['retained'] / GB:.2f} GB (parameters: {conv['params'] / GB:.2f} GB; the originals are kept "
          f"for unpatch), exact={conv['exact']}")
    result = {"args": vars(args), "fwd_bwd_s": t, "peak_rss": peak, "peak_above_steady": act, "loss": loss,
              "convert": conv}
    if args.json:
        write_json(Path(args.json), result)
    return result


if __name__ == "__main__":
    main()
