"""DyT, Peri-LN and Mix-LN on SmolLM2-135M without training: the loss on held-out text and the logit change on the
calibration batch, before and after `hfpatch.calibrate`; each patch undone exactly before the next.

    python -m eval.norms_2025_smollm2 --out eval/results/norms_2025/smollm2.json

Text: *Emma* from ../shared/data/books (characters 200,000 to 260,000): the calibration batch is its first 2 x 256
tokens, the held-out batch 2 x 512 tokens from token 2,048 on, so the two never overlap.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch

import hfpatch
from hfpatch.models import load

BOOK = Path(__file__).resolve().parents[2] / "shared" / "data" / "books" / "emma.txt"
PATCHES = [{"norm": "dyt"}, {"placement": "peri"}, {"placement": "mix"}]  # mix adds no weights: nothing to fit


@torch.no_grad()
def held_out_loss(model, ids: torch.Tensor) -> float:
    return float(model(ids, labels=ids).loss)


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits


def measure(model, calib: torch.Tensor, held: torch.Tensor, base: torch.Tensor) -> dict:
    change = (logits(model, calib) - base).abs()
    return {"held_out_loss": held_out_loss(model, held), "calib_logit_mean_diff": float(change.mean()),
            "calib_logit_max_diff": float(change.max())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="eval/results/norms_2025/smollm2.json")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")  # the swaps warn that they change the function: that is what is measured
    torch.manual_seed(0)
    model, tok = load("smollm2", dtype=torch.float32)
    model.eval()
    ids = tok(BOOK.read_text()[200_000:260_000], return_tensors="pt").input_ids[0]
    calib, held = ids[:512].reshape(2, 256), ids[2048:2048 + 1024].reshape(2, 512)
    base = logits(model, calib)
    rows = {"unpatched": {"held_out_loss": held_out_loss(model, held)}}
    for kwargs in PATCHES:
        name = hfpatch.spec.describe_string(hfpatch.spec.request(**kwargs))
        hfpatch.patch(model, **kwargs)
        rows[name] = measure(model, calib, held, base)
        if kwargs != {"placement": "mix"}:
            t0 = time.perf_counter()
            hfpatch.calibrate(model, calib)
            rows[f"{name}, calibrated"] = {**measure(model, calib, held, base),
                                           "calibrate_s": round(time.perf_counter() - t0, 1)}
        hfpatch.unpatch(model)
        assert float((logits(model, calib) - base).abs().max()) == 0.0, f"{name}: unpatch was not exact"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": "SmolLM2-135M-Instruct", "dtype": "float32", "text": "emma.txt",
                                          "rows": rows}, indent=1) + "\n")
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
