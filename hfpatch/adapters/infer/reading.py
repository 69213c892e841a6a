"""What the readers of `infer` share: the probe forward's record of one model (`Info`), the blocks as the probe
saw them (`Stack`), and small tests on recorded tensors and calls.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from .. import probe as probes

LINEARS = (nn.Linear, Conv1D)


class InferenceError(ValueError):
    """The model's structure could not be read (no blocks, no attention, ...): nothing can be patched."""


@dataclass
class Info:
    model: PreTrainedModel
    probe: probes.Probe
    prefix: str  # name prefix of the base model inside the top model ("model." or "")

    def call(self, name: str):
        return self.probe.calls.get(name)

    def rel(self, name: str) -> str:
        return name[len(self.prefix):] if name.startswith(self.prefix) else name


TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-9, 1e-9)}


def same(a: Any, b: Any) -> bool:
    if a is None or b is None or a.shape != b.shape:
        return False
    rtol, atol = TOLERANCES.get(a.dtype, (2e-2, 2e-2))
    return bool(torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol * max(1.0, float(b.abs().max()))))


def layer_index(name: str, layers: str) -> tuple[int, str] | None:
    m = re.match(re.escape(layers) + r"\.(\d+)(?:\.(.*))?$", name)
    return (int(m.group(1)), m.group(2) or "") if m else None


@dataclass
class Stack:
    """The transformer blocks as the probe saw them."""

    top: str  # top-model path of the ModuleList
    blocks: list
    attention: str | None  # the attention module's path inside a block (None: not found)
    attention_layers: tuple  # the blocks that hold it (empty where it was not found)

    @property
    def mixing(self):
        """The blocks to read: those with the attention module, or all of them where none was found."""
        return self.attention_layers or range(len(self.blocks))

    @property
    def first(self) -> int:
        return next(iter(self.mixing), 0)

    @property
    def ref(self) -> str:
        """Top-model path of the first block read."""
        return f"{self.top}.{self.first}"

    @property
    def hybrid(self) -> bool:
        """Only some blocks have attention (the others another token mixer)."""
        return bool(self.attention_layers) and len(self.attention_layers) != len(self.blocks)


def call_order(info: Info) -> Callable[[str], int]:
    return lambda name: info.probe.calls[name].order


def is_linear(module: nn.Module) -> bool:
    """nn.Linear, GPT-2's Conv1D, or a peft tuner layer around one (the exact conversion then refuses with what
    to do, instead of folding into the wrapped base layer while the adapter keeps reading the norm's output)."""
    return isinstance(module, LINEARS) or hasattr(module, "base_layer")


def linear_calls(info: Info, within: str) -> list[tuple[str, probes.Call]]:
    return [(n, c) for n, c in info.probe.calls.items()
            if n.startswith(within) and is_linear(info.model.get_submodule(n)) and ".base_layer" not in n]


def combos(items: list, size: int) -> list[list]:
    if size == 1:
        return [[x] for x in items]
    return [[a, b] for k, a in enumerate(items) for b in items[k + 1:]]

