"""attention_temperature=...: a training-free query scale that grows with position past the trained window, on top
of any position scheme (`none` included). It is its own patch axis, applied after the position scheme.

The registry `TEMPERATURES` holds one record per kind: its scale s(p) of the 0-based query position p, its options,
and whether it needs the trained window W.

- "logn" (Qwen's logn attention): s = max(1, log(p + 1) / log(W)), 1 at every position inside the window;
- "llama4" (Llama 4's attention temperature tuning): s = 1 + attn_scale · log(floor((p + 1) / floor_scale) + 1),
  1 below position floor_scale - 1 (defaults attn_scale 0.1, floor_scale 8192, as transformers' Llama4TextConfig).

How: each attention module gets a `Tuning` (through the edit log) and the model a registered attention function
(`tempered`) that multiplies the query it receives by s(position), then calls the function the model ran before
(sdpa, eager's own module-level function, or a position scheme's own such as ALiBi's). The query it receives is the
one after RoPE and qk-norm, which is where Llama 4 and Qwen scale it. Query positions are the `position_ids` the
attention call receives (generate() passes them), else the last q of the key slots (slots.positions).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ...adapters import Adapter
from ...adapters.probe import close, probe_logits
from ...edits import Edits
from ...registry import Registry
from ..checks import number, positive_int
from . import paths
from .modules import attention_modules
from .slots import positions

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SDPA_NAME = "hfpatch_temperature"  # wraps functions that take sdpa's mask (sdpa, hfpatch's own functions)
EAGER_NAME = "hfpatch_temperature_eager"  # wraps functions that take eager's float mask
STATE_ATTR = "hfpatch_temperature"


# ----------------------------------------------------------------------------------------------------- the kinds

def logn_scale(pos: torch.Tensor, opts: dict, window: int | None) -> torch.Tensor:
    """max(1, log(p) / log(W)) with p the 1-based position, in float64."""
    assert window is not None  # the kind needs a window: checked when patching
    return (torch.log(pos.double() + 1.0) / math.log(window)).clamp(min=1.0)


def llama4_scale(pos: torch.Tensor, opts: dict, window: int | None) -> torch.Tensor:
    """1 + attn_scale · log(floor((p + 1) / floor_scale) + 1) with p the 0-based position, in float64."""
    floors = torch.floor((pos.double() + 1.0) / opts["floor_scale"])
    return 1.0 + opts["attn_scale"] * torch.log1p(floors)


def _window(name: str, value: Any) -> int:
    value = positive_int(name, value)
    if value < 2:  # log(W) is the divisor
        raise ValueError(f"{name} must be at least 2 (the trained window; logn divides by log(window)), got {value}")
    return value


def _attn_scale(name: str, value: Any) -> float:
    return number(name, value, at_most=100.0, why="the temperature's growth per doubling of floor_scale steps")


@dataclass(frozen=True)
class Temperature:
    scale: Callable[[torch.Tensor, dict, int | None], torch.Tensor]  # (0-based positions, opts, window) -> float64
    summary: str
    options: dict = field(default_factory=dict)  # name -> validator(name, value) -> normalized value
    needs_window: bool = False
    defaults: dict = field(default_factory=dict)  # the values of options left out (describe() shows them)
    exact_within: str = "the trained window"  # where s = 1, so the logits are the model's own (docs, describe)


TEMPERATURES: Registry[Temperature] = Registry.of("attention temperature", {
    "logn": Temperature(logn_scale, "Qwen's logn attention: the query times max(1, log(p) / log(W)), p the 1-based "
                        "position, W the trained window (window= overrides it)", {"window": _window},
                        needs_window=True),
    "llama4": Temperature(llama4_scale, "Llama 4's attention temperature tuning: the query times 1 + attn_scale · "
                          "log(floor((p + 1) / floor_scale) + 1), p the 0-based position (defaults 0.1 and 8192)",
                          {"attn_scale": _attn_scale, "floor_scale": positive_int},
                          defaults={"attn_scale": 0.1, "floor_scale": 8192},  # transformers' Llama4TextConfig's
                          exact_within="positions below floor_scale - 1"),
})


def request(value: Any) -> dict:
    """Validate attention_temperature=: a kind name, or {"kind": name, **options}. Returns {"kind": ..., **options}
    (only the options given)."""
    if isinstance(value, str):
        value = {"kind": value}
    if not isinstance(value, dict) or not isinstance(value.get("kind"), str):
        raise TypeError(f"attention_temperature must be one of {', '.join(map(repr, TEMPERATURES))}, or a dict "
                        f"{{'kind': ..., option: value}}; got {value!r}")
    kind = value["kind"].strip().lower()
    if kind not in TEMPERATURES:
        raise ValueError(f"unknown attention_temperature {value['kind']!r}; valid: {', '.join(TEMPERATURES)}")
    record = TEMPERATURES[kind]
    options = {k: v for k, v in value.items() if k != "kind"}
    unknown = sorted(set(options) - set(record.options))
    if unknown:
        raise ValueError(f"attention_temperature={kind!r} does not take {', '.join(unknown)}; it accepts: "
                         f"{', '.join(sorted(record.options)) or 'no options'}")
    return {"kind": kind, **{k: record.options[k](k, options[k]) for k in sorted(options)}}


def all_options() -> set[str]:
    return set().union(*(set(t.options) for t in TEMPERATURES.values()))


def unavailable(kind: str, adapter: Adapter, req: dict | None = None) -> str | None:
    """Why attention_temperature=`kind` (with the options of `req`, if given) does not apply to a model with this
    adapter (None: it applies)."""
    if not adapter.attention_interface:
        return (f"attention_temperature={kind!r} scales the query inside a registered attention function, but "
                f"{adapter.model_type}'s attention does not go through transformers' attention interface "
                f"({adapter.notes.get('attention', '')})")
    if TEMPERATURES[kind].needs_window and adapter.window is None and not (req or {}).get("window"):
        return (f"attention_temperature={kind!r} grows past the trained window, and {adapter.model_type}'s config "
                "names none (no max_position_embeddings): pass it, e.g. attention_temperature={'kind': "
                f"{kind!r}, 'window': 4096}}")
    return None


# ------------------------------------------------------------------------------------------ the attention function

@dataclass(frozen=True)
class Tuning:
    """One attention module's temperature: the kind, its options, the window, and the function the model ran
    before. `neutral`: s = 1 everywhere (the patch-time check)."""

    kind: str
    opts: dict
    window: int | None
    inner: Callable
    neutral: bool = False


def _tuning(module: nn.Module) -> Tuning:
    tuning = getattr(module, STATE_ATTR, None)
    if tuning is None:
        raise RuntimeError(f"{type(module).__name__} runs hfpatch's attention temperature function but was not "
                           "patched with it (an attention module hfpatch did not find)")
    return tuning


def scaled_query(tuning: Tuning, query: torch.Tensor, key: torch.Tensor, position_ids: Any) -> torch.Tensor:
    """query [b, H, q, d] times s(position), computed at float32 at least and rounded once, as Llama 4 does."""
    if tuning.neutral:
        return query
    b, _, q_len, _ = query.shape
    pos, _ = positions(position_ids, b, q_len, key.shape[2], query.device)
    scale = TEMPERATURES[tuning.kind].scale(pos, tuning.opts, tuning.window)
    wide = torch.promote_types(query.dtype, torch.float32)
    return (query * scale[:, None, :, None].to(wide)).to(query.dtype)


def tempered(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: Any,
             attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    tuning = _tuning(module)
    query = scaled_query(tuning, query, key, kwargs.get("position_ids"))
    return tuning.inner(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(SDPA_NAME, tempered)
AttentionInterface.register(EAGER_NAME, tempered)
AttentionMaskInterface.register(SDPA_NAME, sdpa_mask)
AttentionMaskInterface.register(EAGER_NAME, eager_mask)

# the wrapper's name for each mask function the wrapped one takes
_BY_MASK: dict[Any, str] = {sdpa_mask: SDPA_NAME, eager_mask: EAGER_NAME}


# -------------------------------------------------------------------------------------------------------- apply

def _inner(attn: Callable, implementation: str, kind: str) -> Callable:
    """The attention function `attn` runs now: the registered one, or for "eager" its family's own module-level
    eager_attention_forward (transformers' fallback)."""
    if implementation == "eager":
        fn = getattr(inspect.getmodule(type(attn)), "eager_attention_forward", None)
    else:
        fn = ALL_ATTENTION_FUNCTIONS.get(implementation)
    if fn is None:
        raise ValueError(f"attention_temperature={kind!r} wraps the attention function the model runs, and "
                         f"{type(attn).__module__} has none for attn_implementation={implementation!r}")
    return fn


def apply_temperature(model: PreTrainedModel, adapter: Adapter, req: dict, edits: Edits) -> dict:
    """Each attention module gets its Tuning, the model the wrapper of its attention function. Returns the facts
    (the window it grows past, where the kind has one)."""
    kind = req["kind"]
    reason = unavailable(kind, adapter, req)
    if reason:
        raise ValueError(reason)
    record = TEMPERATURES[kind]
    window = (req.get("window") or adapter.window) if record.needs_window else None
    implementation = model.config._attn_implementation
    name = _BY_MASK.get(ALL_MASK_ATTENTION_FUNCTIONS.get(implementation))
    if name is None:
        raise ValueError(f"attention_temperature={kind!r} wraps attention functions that take sdpa's or eager's "
                         f"mask; this model runs attn_implementation={implementation!r} (load it with 'sdpa' or "
                         "'eager')")
    chosen = {k: v for k, v in record.defaults.items() if k not in req}
    opts = {**chosen, **{k: v for k, v in req.items() if k not in ("kind", "window")}}
    modules = attention_modules(model, adapter)
    tunings = [Tuning(kind, opts, window, _inner(attn, implementation, kind)) for attn in modules]
    check = not any(p.device.type == "meta" for p in model.parameters())  # a reload builds on meta: no check
    before = probe_logits(model, f"attention_temperature={kind!r}", "as it is") if check else None
    paths.remember_base(model, edits)  # the loaded implementation, for paths that need it (flash-attn)
    for c in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        edits.set(c, "_attn_implementation_internal", name)
    if before is not None:
        # With s = 1 the wrapper must hand every call on unchanged: the model's own logits, or it is refused
        for attn, tuning in zip(modules, tunings):
            edits.set(attn, STATE_ATTR, Tuning(kind, opts, window, tuning.inner, neutral=True))
        after = probe_logits(model, f"attention_temperature={kind!r}", f"with attention_temperature={kind!r}")
        if not close(before, after):
            raise ValueError(f"attention_temperature={kind!r} does not reproduce {adapter.model_type}'s attention "
                             "through the wrapped attention function (with the scale 1 its logits differ by "
                             f"{(before.float() - after.float()).abs().max().item():.3g})")
    for attn, tuning in zip(modules, tunings):
        edits.set(attn, STATE_ATTR, tuning)
    return {**chosen, **({"window": window} if window is not None else {})}

