"""Block forwards written over an adapter's paths (attention, MLP, the two norms), in the placements hfpatch can
move a block between:

    pre:       h = x + A(N1(x));  y = h + M(N2(h))        (GPT-2 onwards, Llama, ...)
    post:      h = N1(x + A(x));  y = N2(h + M(h))        (the original Transformer)
    parallel:  y = x + A(N1(x)) + M(N2(x))                (GPT-NeoX; its post form is the sequential one)
    peri:      h = x + O1(A(N1(x)));  y = h + O2(M(N2(h)))  (Peri-LN: output norms O1, O2 before each residual add)
    parallel_peri:  y = x + O1(A(N1(x))) + O2(M(N2(x)))

A block class gets one of them mixed in (`Edits.mix_in`, so gradient checkpointing, which wraps the class's
forward, keeps working). The attention module is called with the block's own arguments, bound by name through the
original forward's signature. Inference runs the form of the block's *own* placement on the probe's inputs and
accepts the forms only where it reproduces the block's output: a block that does anything else (a residual scale, a
cross-attention, an extra sublayer) gets no placement swap.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .base import get_path


@dataclass(frozen=True)
class BlockSpec:
    """What a generic form needs of a block (paths relative to the block)."""

    placement: str  # the form to run: "pre" | "post" | "parallel"
    attention: str | None  # typed as Adapter's fields; a block with a form has both (placement_forms)
    mlp: str | None
    norms: tuple[str, ...]  # two
    dropouts: tuple[str | None, str | None] = (None, None)  # residual dropouts after attention / MLP
    outputs: tuple[str, str] | None = None  # the peri forms' output norms after attention / MLP


SPEC_ATTR = "hfpatch_block"
_SIGNATURES: dict = {}


def _bound(forward: Callable[..., Any], hidden_states: torch.Tensor, args: tuple, kwargs: dict[str, Any]) -> dict:
    """The block's arguments other than hidden_states, by name (positional ones bound through the signature)."""
    fn = getattr(forward, "__func__", forward)
    if fn not in _SIGNATURES:
        _SIGNATURES[fn] = inspect.signature(forward)
    sig = _SIGNATURES[fn]
    bound = sig.bind_partial(hidden_states, *args, **kwargs)
    out = {}
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            out[name] = value
    first = next(iter(sig.parameters))
    out.pop(first, None)
    return out


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, tuple) else out


def _drop(block: nn.Module, path: str | None, x: Any) -> Any:
    return x if path is None else get_path(block, path)(x)


class GenericBlock:
    """Mixed into a block class; the instance carries its BlockSpec in `hfpatch_block`."""

    def forward(self, hidden_states, *args, **kwargs):
        spec: BlockSpec = getattr(self, SPEC_ATTR)
        return run(self, spec, super().forward, hidden_states, args, kwargs)


def run(block: nn.Module, spec: BlockSpec, forward: Callable[..., Any], hidden_states: torch.Tensor, args: tuple,
        kwargs: dict[str, Any]) -> torch.Tensor:
    """One block forward in the form `spec.placement`; `forward` is the block's own (for its signature)."""
    kw = _bound(forward, hidden_states, args, kwargs)
    attn, mlp = get_path(block, spec.attention), get_path(block, spec.mlp)
    n1, n2 = (get_path(block, n) for n in spec.norms)
    x = hidden_states
    if spec.placement == "pre":
        h = x + _drop(block, spec.dropouts[0], _first(attn(hidden_states=n1(x), **kw)))
        return h + _drop(block, spec.dropouts[1], _first(mlp(n2(h))))
    if spec.placement == "post":
        h = n1(x + _drop(block, spec.dropouts[0], _first(attn(hidden_states=x, **kw))))
        return n2(h + _drop(block, spec.dropouts[1], _first(mlp(h))))
    if spec.placement == "parallel":
        a = _drop(block, spec.dropouts[0], _first(attn(hidden_states=n1(x), **kw)))
        return x + a + _drop(block, spec.dropouts[1], _first(mlp(n2(x))))
    if spec.placement in ("peri", "parallel_peri") and spec.outputs is not None:
        o1, o2 = (get_path(block, o) for o in spec.outputs)
        h = x + _drop(block, spec.dropouts[0], o1(_first(attn(hidden_states=n1(x), **kw))))
        m = _drop(block, spec.dropouts[1], o2(_first(mlp(n2(h if spec.placement == "peri" else x)))))
        return h + m
    raise ValueError(f"no generic block form {spec.placement!r}")
