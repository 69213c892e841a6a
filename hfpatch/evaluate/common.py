"""What the two evaluation commands share: argument parsing, loading, patch specs, the resumable results file."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import re
from pathlib import Path

from .. import cli


def run_main(fn, argv, prog: str) -> int:
    """Run an evaluation command: bad input is one line on stderr and exit code 2, an interruption says how to
    resume."""
    return cli.run_main(fn, argv, prog, interrupted="run the same command again to resume from the results file")


# ---------------------------------------------------------------------------------------------------------------
# arguments


def parse_length(text: str) -> int:
    """'2k' = 2048, '1.5k' = 1536, '16384' = 16384 (k = 1024: trained windows are powers of two)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kK]?)\s*", text)
    if not m:
        raise ValueError(f"length {text!r} is not a number of tokens (e.g. 2048, 2k, 1.5k)")
    value = float(m.group(1)) * (1024 if m.group(2) else 1)
    if value != int(value) or value < 2:
        raise ValueError(f"length {text!r} must be a whole number of tokens >= 2")
    return int(value)


def parse_lengths(text: str) -> list[int]:
    lengths = [parse_length(t) for t in text.split(",") if t.strip()]
    if not lengths:
        raise ValueError("--lengths is empty")
    if len(set(lengths)) != len(lengths):
        raise ValueError(f"--lengths repeats a length: {text}")
    return sorted(lengths)


def length_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def parse_patches(text: str) -> list[tuple[str, dict]]:
    """'none,yarn:2,ntk:2' -> [(name, patch kwargs)], every spec validated (no model needed) before any work."""
    from .. import spec as specs

    out, seen = [], {}
    for raw in _split_specs(text):
        kwargs = specs.parse(raw)
        try:
            canonical = json.dumps(specs.request(**kwargs), sort_keys=True)
        except (ValueError, TypeError) as e:
            raise type(e)(f"patch spec {raw!r}: {e}") from None
        if canonical in seen:
            raise ValueError(f"patch specs {seen[canonical]!r} and {raw!r} are the same patch")
        seen[canonical] = raw
        out.append((raw, kwargs))
    if not out:
        raise ValueError("--patches is empty")
    return out


def _split_specs(text: str) -> list[str]:
    """Split on commas that are not inside [...] (longrope lists: 'longrope:4:short_factor=[1,1]')."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="hub id, local folder, .gguf file, or smollm2 (the embedded default; default)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16", "auto"],
                   help="weights dtype (default fp32; auto = the checkpoint's)")
    p.add_argument("--device-map", dest="device_map",
                   help="'auto' shards the model over the GPUs present (accelerate big-model inference)")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu); "
                                    "ignored with --device-map")
    p.add_argument("--patches", default="none,yarn:2",
                   help="comma-separated patch specs, each applied to the same loaded model and removed again: "
                        "none, yarn:2, ntk:2, dynamic, linear:2, yarn:4:beta_fast=16, ... (default none,yarn:2)")


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def load_tokenizer(name: str):
    """The model's tokenizer, after checking from the config alone that the model is a causal LM: both before
    the weights are loaded, so that those errors come at once."""
    from transformers import AutoConfig, AutoTokenizer

    from ..models import resolve
    from .score import check_causal_config

    where, gguf_file = resolve(name)
    if not gguf_file:
        try:
            config = AutoConfig.from_pretrained(where)
        except (OSError, ValueError):
            config = None  # loading the model will say what is wrong with it
        if config is not None:
            check_causal_config(config)
    try:
        return AutoTokenizer.from_pretrained(where, **({"gguf_file": gguf_file} if gguf_file else {}))
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load a tokenizer for {name!r}: {str(e).strip().splitlines()[0]}") from None


def load_model(args):
    import torch

    from ..models import load

    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype in DTYPES else ("auto" if args.dtype == "auto" else None)
    model, _ = load(args.model, dtype=dtype, device_map=args.device_map, tokenizer=False)
    if not args.device_map:
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        model.to(device)
    return model.eval()


def trained_window(model) -> int | None:
    """The context the model was trained for, as the RoPE schemes read it (None if the config does not say)."""
    from ..apply import unwrap
    from ..position.patch import trained_window as window

    config = unwrap(model).config
    params = getattr(config, "rope_parameters", None)
    try:
        return window(config, params if isinstance(params, dict) else {})
    except (AttributeError, TypeError):  # no max_position_embeddings at all
        return None


def check_patches(model, patches) -> None:
    """Apply and remove every spec once before scoring anything: a spec that does not fit this model (yarn on
    gpt2, say) fails now, not after an hour of other cells."""
    for name, kwargs in patches:
        with applied(model, kwargs, name):
            pass


@contextlib.contextmanager
def applied(model, kwargs: dict, name: str):
    import hfpatch

    if kwargs:
        try:
            hfpatch.patch(model, **kwargs)
        except (ValueError, TypeError) as e:
            raise type(e)(f"patch spec {name!r}: {e}") from None
    try:
        yield model
    finally:
        if kwargs:
            hfpatch.unpatch(model)


def position_limit(model) -> int | None:
    """The hard limit of a learned absolute position table still in use (gpt2, opt, interpolated or not): past it
    the model fails with an index error deep inside. None otherwise: RoPE only degrades past its window (that is
    what the evaluations measure), and ALiBi / NoPE / sinusoidal no longer read the table."""
    from ..adapters import adapter_for
    from ..apply import position_limit as limit, unwrap

    adapter = adapter_for(unwrap(model))
    if not adapter.position_table:
        return None
    return limit(model)


def versions() -> dict:
    import torch
    import transformers

    import hfpatch

    out = {"hfpatch": hfpatch.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
           "python": platform.python_version()}
    try:
        import datasets

        out["datasets"] = datasets.__version__
    except ImportError:
        pass
    return out


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def finite(x: float):
    """JSON has no inf/nan: a perplexity that overflows is written as null."""
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


# ---------------------------------------------------------------------------------------------------------------
# resumable results


class Results:
    """A JSON results file written after every finished unit of work (a document of a cell, a passkey trial).

    `identity` is everything that decides the numbers besides the cell coordinates (model, dtype, corpus, ...).
    Restarting with the same identity continues the file; cells already complete are not computed again. A file
    written for another identity is refused (pass --overwrite to start over)."""

    def __init__(self, path: Path, kind: str, identity: dict, overwrite: bool = False):
        self.path = Path(path)
        self.data = None
        if self.path.exists() and not overwrite:
            try:
                data = json.loads(self.path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"{self.path}: unreadable results file ({e}); "
                                 "pass --overwrite to start over") from None
            if data.get("kind") != kind:
                raise ValueError(f"{self.path} holds {data.get('kind')!r} results, not {kind!r}; use another --out")
            if data.get("identity") != identity:
                diff = sorted(k for k in set(identity) | set(data.get("identity", {}))
                              if identity.get(k) != data.get("identity", {}).get(k))
                raise ValueError(f"{self.path} was written by a run with other settings ({', '.join(diff)} differ); "
                                 "use another --out, or --overwrite to discard it")
            self.data = data
        if self.data is None:
            self.data = {"kind": kind, "format": 1, "identity": identity, "cells": [], "started": now()}
        self.resumed = bool(self.data["cells"])

    def find(self, key: dict) -> dict | None:
        return next((c for c in self.data["cells"] if all(c.get(k) == v for k, v in key.items())), None)

    def cell(self, key: dict, make) -> dict:
        """The cell with these coordinates, created by make() if absent."""
        c = self.find(key)
        if c is not None:
            return c
        c = make()
        self.data["cells"].append(c)
        return c

    def save(self, **top) -> None:
        self.data.update(top)
        self.data["updated"] = now()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        os.replace(tmp, self.path)  # atomic: an interruption never leaves half a file
