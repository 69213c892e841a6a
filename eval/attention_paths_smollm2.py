"""Which attention path hfpatch.describe() reports for SmolLM2-135M (the model in the wheel) patched with each scheme
that brings its own attention function, after one forward on the CPU: the model is patched, describe()'s position
entry is read (the patch's own checks count too), one forward of the base model runs at LENGTH tokens without
gradients, and describe() is read again. Token ids are drawn at random: which path runs depends on the call's shape,
device, dtype and grad mode, not on the text.

    OMP_NUM_THREADS=1 python -m eval.attention_paths_smollm2          # alibi, t5, self-extend at 2048: ~1 min

Writes eval/results/attention/smollm2_paths.json; eval/docs_tables.py renders it (tables() below) into
docs/generated/attention_paths_smollm2.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

import hfpatch
from hfpatch.evaluate.common import versions
from hfpatch.evaluate.report import markdown_table
from hfpatch.models import load

HERE = os.path.dirname(os.path.abspath(__file__))
# patch spec -> patch() options; Self-Extend as the docs run it on SmolLM2 (trained on 8k: W = 1024 inside it)
PATCHES = {
    "alibi": {"position": "alibi"},
    "t5": {"position": "t5"},
    "self-extend:group_size=8:window=1024": {"position": "self-extend", "group_size": 8, "window": 1024},
}


def attention_path(model) -> dict:
    return hfpatch.describe(model)["position"]["attention_path"]


def forward_seconds(model, length: int) -> float:
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    with torch.no_grad():
        model.model(ids)
    return time.perf_counter() - t0


def measure(model, options: dict, length: int) -> dict:
    hfpatch.patch(model, **options)
    try:
        after_patch = attention_path(model)
        seconds = forward_seconds(model, length)
        return {"after_patch": after_patch, "after_forward": attention_path(model), "forward_seconds": seconds}
    finally:
        hfpatch.unpatch(model)


def tables(results: dict) -> str:
    """The docs' table (one row per patch) and describe()'s attention_path entry after the forward, as returned."""
    s = results["settings"]
    head = ["patch", "paths, in the order tried", "calls after patching", f"calls after one forward at {s['length']}",
            "forward (s)"]
    rows = []
    for spec, r in results["patches"].items():
        ran = r["after_forward"]["ran"]
        rows.append([f"`{spec}`", ", ".join(r["after_forward"]["order"]), _calls(r["after_patch"]["ran"]),
                     _calls(ran), f"{r['forward_seconds']:.1f}"])
    shown = {spec: r["after_forward"] for spec, r in results["patches"].items()}
    return "\n".join([
        f"SmolLM2-135M (30 layers), {s['dtype']}, {s['device'].upper()}, {s['threads']} thread(s); one forward of the "
        f"base model at {s['length']} tokens, no gradients; torch {results['versions']['torch']}, transformers "
        f"{results['versions']['transformers']}. The same forward unpatched (RoPE, sdpa): "
        f"{results['unpatched_seconds']:.1f} s.", "",
        markdown_table(head, rows), "",
        "`hfpatch.describe(model)[\"position\"][\"attention_path\"]` after the forward, per patch:", "",
        "```text", *[f"{spec}: {entry}" for spec, entry in shown.items()], "```"])


def _calls(ran: dict) -> str:
    return ", ".join(f"{path} x{n}" for path, n in ran.items()) or "none"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--out", default=os.path.join(HERE, "results", "attention", "smollm2_paths.json"))
    args = p.parse_args(argv)
    model, _ = load("smollm2", tokenizer=False)
    model.eval()
    results = {
        "settings": {"model": "smollm2", "length": args.length, "dtype": str(model.dtype).removeprefix("torch."),
                     "device": model.device.type, "threads": torch.get_num_threads(),
                     "machine": platform.machine(), "argv": sys.argv[1:]},
        "versions": versions(),
        "unpatched_seconds": forward_seconds(model, args.length),
        "patches": {},
    }
    for spec, options in PATCHES.items():
        results["patches"][spec] = measure(model, options, args.length)
        print(f"{spec}: {results['patches'][spec]}", file=sys.stderr, flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    print(tables(results))


if __name__ == "__main__":
    main()
