"""What vLLM serves from a saved LongRoPE checkpoint with an explicit attention factor, with and without the engine
keys hfpatch.save_pretrained writes (short_mscale / long_mscale): mean NLL per token on the same window of one book,
in transformers and in vLLM.

    python -m eval.vllm_saved_keys --json eval/results/cross_engine_vllm/longrope_keys.json

SmolLM2-135M patched with eval/cross_engine.py's LongRoPE spec (plain RoPE within the trained window, a ramp beyond)
and attention_factor=1 (no magnitude correction, where LongRoPE's default for a factor of 4 is 1.074) is saved
once; a copy of the folder has the two keys taken out of config.json, as a checkpoint saved without them
would be. Both folders are scored by vLLM (its own Python: --engine-python), the model itself by transformers.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import torch

import hfpatch
from eval.cross_engine import BOOKS, LONGROPE, percent
from hfpatch import spec as specs
from hfpatch.evaluate.report import markdown_table
from hfpatch.evaluate.vllm_engine import DEFAULT_PYTHON, Worker
from hfpatch.interop.serving import ATTENTION_KEYS
from hfpatch.lm.causal import causal_lm_parts, window_nll
from hfpatch.models import load

ATTENTION_FACTOR = 1.0
SPEC = f"{LONGROPE}:attention_factor={ATTENTION_FACTOR}"


def measure(args) -> dict:
    model, tok = load("smollm2")
    kwargs = specs.parse(SPEC)
    hfpatch.patch(model, **kwargs)
    ids = tok(Path(args.book).read_text())["input_ids"][: args.length]
    with torch.no_grad():
        nll, n = window_nll(causal_lm_parts(model), torch.tensor(ids), 1, 1024)
    rows = {"transformers": nll / n}
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        with_keys = Path(tmp) / "with_keys"
        hfpatch.save_pretrained(model, with_keys)
        without = Path(tmp) / "without_keys"
        shutil.copytree(with_keys, without)
        config = json.loads((without / "config.json").read_text())
        saved = {k: config["rope_parameters"].pop(k) for k in ATTENTION_KEYS["longrope"]}
        (without / "config.json").write_text(json.dumps(config, indent=2))
        worker = Worker(args.engine_python, str(Path(tmp) / "vllm.log"))
        try:
            for name, folder in (("vLLM, saved keys", with_keys), ("vLLM, without them", without)):
                worker.ask({"op": "load", "model": str(folder), "max_model_len": args.length, "dtype": "float32"})
                logprobs = worker.ask({"op": "logprobs", "ids": ids, "first": 1})["logprobs"]
                rows[name] = -math.fsum(logprobs) / len(logprobs)
        finally:
            worker.close()
    return {"command": "python -m eval.vllm_saved_keys " + " ".join(args.argv), "spec": SPEC,
            "book": Path(args.book).name, "tokens": args.length, "saved_keys": saved, "mean_nll": rows}


def table(result: dict) -> str:
    tf = result["mean_nll"]["transformers"]
    rows = [[name, f"{nll:.5f}", "-" if name == "transformers" else percent(abs(nll - tf) / tf)]
            for name, nll in result["mean_nll"].items()]
    keys = ", ".join(f"`{k}` = {v:.5f}" for k, v in result["saved_keys"].items())
    return (f"SmolLM2-135M with `longrope:4` (short factors 1, long factors 1 to 4, `attention_factor` = "
            f"{result['saved_keys']['short_mscale']:g}), the first {result['tokens']:,} "
            f"tokens of {result['book']}, mean NLL per token; the saved keys: {keys}.\n\n"
            + markdown_table(["served by", "NLL", "gap to transformers"], rows))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-python", dest="engine_python", default=str(DEFAULT_PYTHON))
    p.add_argument("--book", default=str(BOOKS / "moby_dick.txt"))
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--tmp", default=None, help="where the two saved folders go (default: the temporary directory)")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    result = measure(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
