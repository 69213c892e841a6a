"""Small pieces the evaluations share: patch specs from the command line, loading the model, applying a spec for a
while, what the results file records about the run. The lengths and depths an evaluation parses are in parsing.py
(no torch there), and importable from here too."""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.metadata
import json
import platform
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import transformers

from .. import __version__
from .. import spec as specs
from ..apply import patch, state_of, unpatch
from ..models import load
from .parsing import finite as finite  # importable from here too
from .parsing import length_label as length_label  # importable from here too
from .parsing import parse_fractions as parse_fractions  # importable from here too
from .parsing import parse_length as parse_length  # importable from here too
from .parsing import parse_lengths as parse_lengths  # importable from here too

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def parse_patches(text: str) -> list[tuple[str, dict]]:
    """'none,yarn:2,ntk:2' -> [(name, patch kwargs)], every spec validated (no model needed) before any work."""
    out: list = []
    seen: dict = {}
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


def dtype_name(dtype: torch.dtype) -> str:
    """The --dtype name of a torch dtype (fp32, bf16, fp16), else torch's own (float64)."""
    name = str(dtype).replace("torch.", "")
    return next((short for short, full in DTYPES.items() if full == name), name)


def torch_dtype(name: str) -> torch.dtype | str | None:
    return getattr(torch, DTYPES[name]) if name in DTYPES else ("auto" if name == "auto" else None)


def check_device(device: str | None) -> None:
    """--device, checked before anything is read or loaded: a device torch knows, and a CUDA device this machine
    has (else moving the model there fails with a RuntimeError, after the plan is built)."""
    if device is None:
        return
    try:
        where = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device!r} is not a device (cpu, cuda, cuda:1, ...)") from None
    if where.type == "cuda" and (where.index or 0) >= (torch.cuda.device_count() if torch.cuda.is_available() else 0):
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s) that torch "
                         "can use")


def load_model(args: argparse.Namespace) -> PreTrainedModel:
    model, _ = load(args.model, dtype=torch_dtype(args.dtype), device_map=args.device_map, tokenizer=False)
    if not args.device_map:
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        model.to(device)  # type: ignore[arg-type]  # (mypy reads transformers' @wraps(Module.to) as unbound)
    return model.eval()


@contextlib.contextmanager
def applied(model: PreTrainedModel, kwargs: dict, name: str) -> Iterator[PreTrainedModel]:
    """The model with the spec applied for a while, then back exactly as it was. `none` (no kwargs) is the model as
    loaded; a spec replaces the patch the model was loaded with on the axes it names (ntk:2 on a model loaded with
    yarn:4 runs ntk:2 over the checkpoint's base RoPE), and that loaded patch is applied again afterwards (unpatch
    alone would leave the checkpoint's base model)."""
    if not kwargs:
        yield model
        return
    loaded = live_spec(model)
    try:
        patch(model, **kwargs)
    except (ValueError, TypeError) as e:
        raise type(e)(f"patch spec {name!r}: {e}") from None
    try:
        yield model
    finally:
        restore(model, loaded)


def live_spec(model: PreTrainedModel) -> dict:
    """The patch applied to `model` now, beyond what is baked into its weights (the part unpatch undoes)."""
    state = state_of(model)
    return copy.deepcopy(state.spec) if state else {}


def restore(model: PreTrainedModel, spec: dict) -> None:
    """Bring `model` back to carrying exactly `spec` (as live_spec gave it): every patch undone, `spec` applied
    again."""
    if live_spec(model) == spec:
        return
    unpatch(model)
    if spec:
        patch(model, **specs.to_kwargs(spec))


def versions() -> dict:
    out = {"hfpatch": __version__, "transformers": transformers.__version__, "torch": torch.__version__,
           "python": platform.python_version()}
    # read from its metadata: importing datasets only for its version costs a second
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        out["datasets"] = importlib.metadata.version("datasets")
    return out
