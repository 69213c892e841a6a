"""Which attention path runs a call, for the schemes that bring their own attention function (ALiBi, T5, XL,
Self-Extend).

Each scheme lists its paths as data, fastest first (`register(scheme, [AttentionPath, ...])`, which the scheme
registry does with its record's `paths`); the written-out path, which takes everything, comes last. Per call the
first path whose conditions hold runs: the device, the dtype, whether gradients are needed, dropout, softcapping,
causal or bidirectional attention, a padding mask, the attention implementation the model was loaded with
(flash-attn paths only for attn_implementation="flash_attention_2"), optional packages, and, for paths whose cost
depends on the size, whether the call is big enough (flex.worth_it: to pay for compiling).
`refusal(path, call)` says why a path does not take a call.

Every call is counted per attention module and path: hfpatch.describe(model)["position"]["attention_path"]
(`describe`) says which paths ran, and the evaluations record it per results cell.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from ...edits import Edits
from ...registry import Registry

ALL_DEVICES = frozenset({"cpu", "cuda"})
LOW = frozenset({torch.float16, torch.bfloat16})


@dataclass(frozen=True)
class Call:
    """What decides the path of one attention call."""

    device: str
    dtype: torch.dtype
    grad: bool  # gradients will flow through the attention
    dropout: bool  # attention dropout is active
    softcap: bool
    causal: bool
    mask: str  # "none" | "bool" | "float": the attention_mask the model passed
    q_len: int
    kv_len: int
    base: str = "sdpa"  # the attn_implementation the model was loaded with


class Runner(Protocol):
    """A path's attention function: query [b, H, q, d], key and value [b, KV, kv, d] (grouped keys as they are),
    the model's attention_mask or None; returns the output [b, q, H, d]."""

    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, *, scaling: float, dropout: float, causal: bool,
                 softcap: float | None, kwargs: dict[str, Any]) -> torch.Tensor: ...


@dataclass(frozen=True)
class AttentionPath:
    """One way to compute a scheme's attention: `run` (a Runner) and the calls it takes."""

    name: str
    run: Runner
    summary: str
    devices: frozenset[str] = ALL_DEVICES
    grad_devices: frozenset[str] = ALL_DEVICES  # where it passes gradients (frozenset(): inference only)
    dtypes: frozenset[torch.dtype] | None = None  # None: any
    dropout: bool = False
    softcap: bool = False
    bidirectional: bool = False
    causal: bool = True
    masks: frozenset[str] = frozenset({"none", "bool", "float"})
    base: frozenset[str] | None = None  # only for models loaded with one of these implementations
    missing: Callable[[], str | None] | None = None  # why it cannot run on this machine at all
    worth: Callable[[Call], str | None] | None = None  # why this call is too small for it (size-dependent paths)


def refusal(path: AttentionPath, call: Call, *, size: bool = True) -> str | None:
    """Why `path` does not take `call`, or None. size=False: whether the call is big enough for a compiled path
    is not asked (a forced path)."""
    if call.device not in path.devices:
        return f"runs on {'/'.join(sorted(path.devices))}, not {call.device}"
    if path.base is not None and call.base not in path.base:
        return f"only for attn_implementation={' or '.join(sorted(path.base))} (loaded with {call.base})"
    if path.dtypes is not None and call.dtype not in path.dtypes:
        return f"no {str(call.dtype).replace('torch.', '')}"
    if call.grad and call.device not in path.grad_devices:
        return f"inference only on {call.device} (gradients are needed)"
    if call.dropout and not path.dropout:
        return "no attention dropout"
    if call.softcap and not path.softcap:
        return "no softcapping"
    if not call.causal and not path.bidirectional:
        return "causal attention only"
    if call.causal and not path.causal:
        return "bidirectional attention only"
    if call.mask not in path.masks:
        return f"no {call.mask} attention mask"
    if path.missing is not None and (why := path.missing()):
        return why
    if size and path.worth is not None and (why := path.worth(call)):
        return why
    return None


_TABLES: Registry[tuple[AttentionPath, ...]] = Registry("attention path table")


def register(scheme: str, table: Iterable[AttentionPath]) -> None:
    """A scheme's paths, fastest first; the last one must take every call."""
    listed = tuple(table)
    if not listed or listed[-1].devices != ALL_DEVICES or listed[-1].masks != AttentionPath.masks:
        raise ValueError(f"{scheme}: the last path must take every call (the written-out one)")
    _TABLES.register(scheme, listed)


def table(scheme: str) -> tuple[AttentionPath, ...]:
    return _TABLES[scheme]


def schemes() -> list[str]:
    return list(_TABLES)


class PathUnavailable(RuntimeError):
    """Raised by a path that turns out not to work here after all (flex failing to compile): the call goes to the
    next path of the table (later calls too: the path's refusal says so from then on)."""


_FORCED: dict[str, str] = {}


def choose(scheme: str, call: Call, skip: frozenset[AttentionPath] = frozenset()) -> AttentionPath:
    if scheme in _FORCED:
        return _forced(scheme, call)
    for path in _TABLES[scheme]:
        if path not in skip and refusal(path, call) is None:
            return path
    return _TABLES[scheme][-1]


def _forced(scheme: str, call: Call) -> AttentionPath:
    name = _FORCED[scheme]
    reasons = []
    for path in _TABLES[scheme]:
        if path.name == name:
            why = refusal(path, call, size=False)
            if why is None:
                return path
            reasons.append(why)
    raise ValueError(f"attention path {name!r} of position={scheme!r} cannot take this call: {'; '.join(reasons)}")


@contextlib.contextmanager
def forcing(scheme: str, name: str) -> Iterator[None]:
    """Within the block, every call of `scheme` runs `name` (whatever its size), or fails saying why it cannot (for
    benchmarks and tests)."""
    if name not in {p.name for p in _TABLES[scheme]}:
        raise ValueError(f"position={scheme!r} has no attention path {name!r}; it has "
                         f"{', '.join(dict.fromkeys(p.name for p in _TABLES[scheme]))}")
    before = _FORCED.get(scheme)
    _FORCED[scheme] = name
    try:
        yield
    finally:
        if before is None:
            _FORCED.pop(scheme, None)
        else:
            _FORCED[scheme] = before


def call_of(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attention_mask: torch.Tensor | None, dropout: float, causal: bool, softcap: float | None) -> Call:
    grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    mask = "none" if attention_mask is None else "bool" if attention_mask.dtype == torch.bool else "float"
    return Call(device=query.device.type, dtype=query.dtype, grad=grad,
                dropout=bool(dropout) and module.training, softcap=softcap is not None, causal=causal, mask=mask,
                q_len=query.shape[2], kv_len=key.shape[2], base=base_of(module))


def run(scheme: str, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        attention_mask: torch.Tensor | None, *, scaling: float, dropout: float, causal: bool,
        kwargs: dict[str, Any]) -> tuple[torch.Tensor, None]:
    """Compute one attention call by the first path that takes it; returns (output [b, q, H, d], None)."""
    softcap = kwargs.get("softcap")
    if dropout and not module.training:
        dropout = 0.0
    call = call_of(module, query, key, value, attention_mask, dropout, causal, softcap)
    skip: dict[AttentionPath, str] = {}  # paths that raised PathUnavailable for this call, and why
    while True:
        path = choose(scheme, call, frozenset(skip))
        try:
            out = path.run(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                           causal=causal, softcap=softcap, kwargs=kwargs)
        except PathUnavailable as e:
            if scheme in _FORCED or path is _TABLES[scheme][-1]:
                raise
            skip[path] = str(e)
            continue
        record(module, path.name)
        if scheme not in _FORCED:
            record_passed_over(module, scheme, call, path, skip)
        return out, None


# ---------------------------------------------------------------------------------------------------- reporting

_RAN: weakref.WeakKeyDictionary[nn.Module, Counter[str]] = weakref.WeakKeyDictionary()
# per attention module: why each path before the one that ran did not take the module's latest call
_PASSED: weakref.WeakKeyDictionary[nn.Module, dict[str, str]] = weakref.WeakKeyDictionary()
BASE_ATTRIBUTE = "_hfpatch_loaded_attention"  # on each module that holds the model's config: the implementation it
# was loaded with. A plain module attribute, so that torch.compile reads it as a constant of the module it guards
# already, where a global table keyed by id(config) would be traced into the graph's guards.


def record(module: nn.Module, path: str) -> None:
    """Count one call of `module` on `path` (the eager functions record theirs too). Not while torch.compile traces
    the call: a compiled graph cannot count its calls, and tracing the update of a module-level weak table put it
    into the graph's guards."""
    if torch.compiler.is_compiling():
        return
    _RAN.setdefault(module, Counter())[path] += 1


def record_passed_over(module: nn.Module, scheme: str, call: Call, chosen: AttentionPath,
                       raised: dict[AttentionPath, str]) -> None:
    """Keep why each path before `chosen` did not take this call (its refusal, or what it raised), for describe()."""
    if torch.compiler.is_compiling():
        return
    why: dict[str, str] = {}
    for path in _TABLES[scheme]:
        if path is chosen:
            break
        reason = raised.get(path) or refusal(path, call)
        if reason:
            why.setdefault(path.name, reason)
    _PASSED[module] = why


def passed_over(model: nn.Module) -> dict[str, str]:
    """{path: why it did not take the latest call} over the model's attention modules (the paths tried before the
    one that ran)."""
    why: dict[str, str] = {}
    for m in model.modules():
        for name, reason in _PASSED.get(m, {}).items():
            why.setdefault(name, reason)
    return why


def ran(model: nn.Module) -> dict[str, int]:
    """Calls per path, summed over the model's attention modules, since the model was loaded or last reset (calls
    made inside a torch.compile'd model are not counted)."""
    total: Counter[str] = Counter()
    for m in model.modules():
        total.update(_RAN.get(m, {}))
    return dict(total)


def reset(model: nn.Module) -> None:
    for m in model.modules():
        _RAN.pop(m, None)
        _PASSED.pop(m, None)


def unavailable(scheme: str) -> dict[str, str]:
    """{path: why it cannot run on this machine at all} (a missing package or device: each path's `missing`)."""
    why: dict[str, str] = {}
    for path in _TABLES[scheme]:
        if path.missing is not None and (reason := path.missing()):
            why.setdefault(path.name, reason)
    return why


def describe(model: nn.Module, scheme: str) -> dict[str, Any]:
    """describe()'s entry for a model patched with `scheme`: {"attention_path": {"order": the paths it can take,
    fastest first, "ran": calls per path so far, "unavailable": {path: why it cannot run on this machine},
    "passed_over": {path: why it did not take the latest call}}}, or {} for a scheme that runs the model's own
    attention."""
    if scheme not in _TABLES:
        return {}
    return {"attention_path": {"order": [p.name for p in _TABLES[scheme]], "ran": ran(model),
                               "unavailable": unavailable(scheme), "passed_over": passed_over(model)}}


def remember_base(model: nn.Module, edits: Edits) -> None:
    """Keep the attn_implementation the model was loaded with, before a patch replaces it with its own function's
    name, so that paths for that implementation (flash-attn) can be chosen: on every module that holds the model's
    config (its attention modules among them), through `edits` (undone with the patch). Not on the config itself,
    whose attributes are saved into config.json."""
    config: Any = model.config
    base = config._attn_implementation
    if base is None or base.startswith("hfpatch_"):  # patched already: keep what was remembered
        return
    configs = (config, config.get_text_config())
    for module in model.modules():
        if any(getattr(module, "config", None) is c for c in configs):
            edits.set(module, BASE_ATTRIBUTE, base)


def base_of(module: nn.Module) -> str:
    """The attn_implementation the model of this attention module was loaded with ("sdpa" if none was kept)."""
    return getattr(module, BASE_ATTRIBUTE, "sdpa")
