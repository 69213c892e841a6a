"""Does patching cost anything at run time? And how long does patch() itself take?

Compares, in one run, the forward time of a model patched by hfpatch with the same weights in a model that
transformers built natively from the equivalent rope_parameters, and times patch() on the loaded model.

    python -m eval.bench_patch                      # SmolLM2-135M (the embedded default), yarn x2, 2048 tokens
    python -m eval.bench_patch --position linear --factor 4 --length 4096 --repeats 9
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import hfpatch
from eval.benchutil import interleaved, markdown_table, median
from hfpatch.models import load
from hfpatch.utils.files import write_json


def native_twin(model):
    """A model built by transformers from the patched model's (native) config, carrying the same weights."""
    d = model.config.to_dict()
    for key in ("quantization_config", "hfpatch"):
        d.pop(key, None)
    config = type(model.config).from_dict(d)
    twin = type(model)(config).eval()
    twin.load_state_dict(model.state_dict())
    return twin


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--position", default="yarn")
    p.add_argument("--factor", type=float, default=2.0)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--patch-repeats", type=int, default=50)
    p.add_argument("--json", help="also write the numbers to this file")
    args = p.parse_args(argv)

    model, _ = load(args.model, tokenizer=False)
    model.eval()
    kwargs = {"position": args.position, **({"factor": args.factor} if args.factor else {})}

    patch_ms = []
    for _ in range(args.patch_repeats):
        hfpatch.unpatch(model)
        t0 = time.perf_counter()
        hfpatch.patch(model, **kwargs)
        patch_ms.append(1000 * (time.perf_counter() - t0))
    if not hfpatch.describe(model)["position"]["native"]:
        raise SystemExit(f"{args.position} has no native transformers form to compare against")
    twin = native_twin(model)

    ids = torch.randint(100, model.config.vocab_size, (1, args.length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(ids[:, :256]).logits - twin(ids[:, :256]).logits).abs().max().item() <= 1e-6
        times = interleaved({"hfpatch": lambda: model.model(ids), "native": lambda: twin.model(ids)}, args.repeats)
    med = {k: median(v) for k, v in times.items()}
    ratio = med["hfpatch"] / med["native"]
    result = {
        "model": args.model, "patch": kwargs, "length": args.length, "repeats": args.repeats,
        "forward_s": med, "forward_ratio_patched_over_native": ratio,
        "patch_ms_median": median(patch_ms), "patch_ms_max": max(patch_ms), "threads": torch.get_num_threads(),
    }
    print(markdown_table(
        ["model", "patch", "tokens", "native forward (s)", "hfpatch forward (s)", "ratio", "patch() ms (median / max)"],
        [[args.model, f"{args.position}:{args.factor:g}", args.length, f"{med['native']:.3f}", f"{med['hfpatch']:.3f}",
          f"{ratio:.3f}", f"{median(patch_ms):.2f} / {max(patch_ms):.2f}"]],
    ))
    if args.json:
        write_json(Path(args.json), result)
    return result


if __name__ == "__main__":
    main()
