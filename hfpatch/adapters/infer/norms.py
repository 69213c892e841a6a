"""Which modules are norms, recognised by what they compute, not by their class name: a module with at most a 1-D
weight and bias, called on one tensor, whose output equals RMSNorm or LayerNorm of its input with scale `weight` or
`1 + weight` and one of the eps values the module or config names (checked in float32 at two input scales, where
eps matters and where it does not). Then the norms of a block in forward order, and the ones outside the blocks.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..base import NormClass, class_key
from .reading import Info, Stack, call_order

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps", "norm_eps")


_EPS_CONFIG = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon")


def _reference(kind: str, x: torch.Tensor, eps: float, scale: torch.Tensor | None,
               bias: torch.Tensor | None) -> torch.Tensor:
    h = x.double()
    if kind == "layernorm":
        h = h - h.mean(-1, keepdim=True)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if scale is not None:
        h = h * scale.double()
    if bias is not None:
        h = h + bias.double()
    return h


def classify_norm(module: nn.Module, config: PreTrainedConfig | None = None) -> NormClass | None:
    """What a norm-like module computes ("rmsnorm"/"layernorm", scale offset, eps), or None if it computes neither.
    Runs a float32 copy of the module on inputs of its own; the module itself is not touched."""
    if list(module.children()):
        return None
    params = dict(module.named_parameters(recurse=False))
    if set(params) - {"weight", "bias"} or any(p.dim() != 1 for p in params.values()):
        return None
    shapes = {p.shape[0] for p in params.values()}
    if len(shapes) > 1:
        return None
    dim = shapes.pop() if shapes else _norm_dim(module)
    if dim is None or dim < 2:
        return None
    candidates: list[tuple[str | None, float]] = []  # (the module's attribute that holds it, eps)
    for a in _EPS_ATTRS:
        v = getattr(module, a, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            candidates.append((a, float(v)))
    for a in _EPS_CONFIG:
        v = getattr(config, a, None) if config is not None else None
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            candidates.append((None, float(v)))
    candidates += [(None, e) for e in (1e-5, 1e-6, 1e-12, 1e-8)]
    try:
        twin = copy.deepcopy(module).float()
    except Exception:  # not copyable: not something we can swap either
        return None
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, dim, generator=g) * s + m for s, m in ((1.0, 0.3), (1e-3, 0.0))]
    try:
        with torch.no_grad():
            ys = [twin(x).double() for x in xs]
    except Exception:  # needs other inputs: not a plain norm
        return None
    if any(y.shape != x.shape for x, y in zip(xs, ys)):
        return None
    weight, bias = params.get("weight"), params.get("bias")
    for kind in ("rmsnorm", "layernorm"):
        for offset in ((0.0, 1.0) if weight is not None else (0.0,)):
            scale = None if weight is None else weight.detach().double().cpu() + offset
            b = None if bias is None else bias.detach().double().cpu()
            for attr, eps in candidates:
                if all(torch.allclose(y, _reference(kind, x, eps, scale, b), rtol=1e-4, atol=1e-5 * max(1.0, _mag(y)))
                       for x, y in zip(xs, ys)):
                    return NormClass(kind=kind, offset=offset, eps=eps, eps_attr=attr,
                                     upcast=_upcast(module, kind, eps, offset, xs[0]))
    return None


def _upcast(module: nn.Module, kind: str, eps: float, offset: float, x: torch.Tensor) -> str | None:
    """How the norm computes in bfloat16, read by running a bfloat16 copy: "fp32" (statistics and scale in float32,
    one rounding at the end: Gemma, hfpatch's own), "normalize" (statistics in float32, the scale applied in the
    input dtype: Llama), "none" (everything in bfloat16), or None if none matches bit for bit."""
    try:
        twin = copy.deepcopy(module).to(torch.bfloat16)
        with torch.no_grad():
            got = twin(x.to(torch.bfloat16))
    except Exception:  # no bfloat16 on this build: unknown
        return None
    w = getattr(twin, "weight", None)
    b = getattr(twin, "bias", None)

    def normed(h: Any) -> Any:
        if kind == "layernorm":
            h = h - h.mean(-1, keepdim=True)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)

    def affine(h: Any, dtype: torch.dtype) -> Any:
        h = h if w is None else h * (w.to(dtype) + offset)
        return h if b is None else h + b.to(dtype)

    xb = x.to(torch.bfloat16)
    forms = {"fp32": affine(normed(xb.float()), torch.float32).to(torch.bfloat16),
             "normalize": affine(normed(xb.float()).to(torch.bfloat16), torch.bfloat16),
             "none": affine(normed(xb), torch.bfloat16)}
    return next((name for name, ref in forms.items() if torch.equal(ref, got)), None)


def _mag(y: Any) -> float:
    return float(y.abs().max())


def _norm_dim(module: nn.Module) -> int | None:
    shape = getattr(module, "normalized_shape", None)
    if isinstance(shape, (tuple, list, torch.Size)) and len(shape) == 1:
        return int(shape[0])
    if isinstance(shape, int):
        return shape
    return None


def read_norms(info: Info, config: PreTrainedConfig, notes: dict) -> tuple[dict, dict]:
    """({module path: NormClass} of every module the probe saw that computes RMSNorm / LayerNorm, {"module.Class":
    NormClass} of their classes)."""
    model, probe = info.model, info.probe
    norm_classes: dict[str, NormClass] = {}
    recognised: dict[str, NormClass] = {}
    for name, call in probe.calls.items():
        module = model.get_submodule(name)
        if call.input is None or not torch.is_floating_point(call.input) or list(module.children()) \
                or len(call.args) + len(call.kwargs) != 1:  # a norm takes one tensor (not a gated norm's two)
            continue
        cls = classify_norm(module, config)
        if cls is not None:
            recognised[name] = cls
            norm_classes.setdefault(class_key(module), cls)
    unrecognised = sorted(n for n, m in model.named_modules()
                          if "norm" in type(m).__name__.lower() and n not in recognised and n in probe.calls
                          and not list(m.children()))
    if unrecognised:
        notes["unrecognised_norms"] = (f"{len(unrecognised)} norm-like module(s) compute neither RMSNorm nor "
                                       f"LayerNorm and are left as they are by norm swaps, e.g. {unrecognised[0]} "
                                       f"({type(model.get_submodule(unrecognised[0])).__name__})")
    return recognised, norm_classes


def read_block_norms(info: Info, stack: Stack, recognised: dict, notes: dict) -> tuple[list, list]:
    """(the block's own norms, its QK norms: those inside the attention module), block-relative, in forward order;
    the same in every block read, or a note says which differs."""
    def of(i: int) -> tuple[list[str], list[str]]:
        names = [n for n in recognised if n.startswith(f"{stack.top}.{i}.")]
        inner = f"{stack.top}.{i}.{stack.attention}." if stack.attention else None
        qk = [n for n in names if inner and n.startswith(inner)]
        own = [n for n in names if n not in qk]
        strip = len(f"{stack.top}.{i}.")
        order = call_order(info)
        return [n[strip:] for n in sorted(own, key=order)], [n[strip:] for n in sorted(qk, key=order)]

    norms, qk_norms = of(stack.first)
    for i in stack.mixing:
        if of(i) != (norms, qk_norms):
            notes["norms"] = f"block {i} has other norms than block {stack.first}"
    return norms, qk_norms


def read_outer_norms(info: Info, stack: Stack, recognised: dict, notes: dict) -> tuple:
    """(final norm, embedding norm, task-head norms): recognised norms of the base model called after the last /
    before the first block, and those outside the base model."""
    probe, prefix = info.probe, info.prefix
    outside = [n for n in recognised if n.startswith(prefix) and not n.startswith(stack.top + ".")]
    called = [probe.calls[f"{stack.top}.{i}"] for i in range(len(stack.blocks)) if f"{stack.top}.{i}" in probe.calls]
    first_start, last_end = min(c.order for c in called), max(c.end for c in called)
    before = [n for n in outside if probe.calls[n].end < first_start]
    after = [n for n in outside if probe.calls[n].order > last_end]
    if len(after) > 1 or len(before) > 1:
        notes["norms"] = f"several norms outside the blocks: {sorted(map(info.rel, before + after))}"
    return (info.rel(after[-1]) if len(after) == 1 else None, info.rel(before[0]) if len(before) == 1 else None,
            tuple(n for n in recognised if prefix and not n.startswith(prefix)))

