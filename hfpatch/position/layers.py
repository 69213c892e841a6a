"""Per-layer positions (`layers=` of a RoPE scheme): some layers carry another position scheme than the rest, e.g.
NoPE in every 4th layer and YaRN elsewhere (Llama 4's iRoPE), or p-RoPE in some layers.

The model's rotary module computes cos and sin once per forward and hands the same pair to every block
(`position_embeddings`). A layer with its own scheme gets a class mix-in (`LayerPositions`, through the edit log: a
class swap keeps gradient checkpointing, an instance `forward` would not) that changes the pair before the block's
attention sees it: NoPE makes it cos 1, sin 0 on every channel (no rotation at all); p-RoPE does so on the channels
of the low-frequency pairs only. So the rest of the model runs the global scheme unchanged, the KV cache holds keys
as each layer rotated them, and a save records the request, not new weights.

Which channels belong to which rotary pair differs between families (rotate-half, interleaved, partial rotation):
it is read off the rotary module itself, by running a copy of it with the dropped pairs' frequencies set to 0.

The registry of per-layer schemes is `schemes.LAYER_SCHEMES`; this module holds the mechanism: layer selectors,
the mix-in, applying and checking it.
"""

from __future__ import annotations

import copy
import numbers
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ..adapters import Adapter, get_path
from ..adapters.infer import mixer_paths
from ..adapters.positions import layer_types
from ..adapters.probe import position_sources
from ..adapters.probe import run as probe_run
from ..edits import Edits
from .rope.builders import kept_pairs
from .rope.rotary import rotaries_of

STATE_ATTR = "hfpatch_layer_positions"
# "every4": the 4th, 8th, ... layer (indices 3, 7, 11, ...: Llama 4's NoPE layers); "every4from0": 0, 4, 8, ...
_EVERY = re.compile(r"every(\d+)(?:from(\d+))?")
SELECTORS = ("a list of layer indices such as [3, 7, 11], 'everyN' (the N-th, 2N-th, ... layer: indices N-1, "
             "2N-1, ...) or 'everyNfromS' (indices S, S+N, S+2N, ...)")


@dataclass(frozen=True)
class LayerScheme:
    """A position scheme that can be given to some layers of a RoPE model: what it does and the options it takes.
    `dropped(inv_freq, opts)`: the rotary pairs (indices into inv_freq) it takes the position out of; None: all."""

    summary: str
    options: dict = field(default_factory=dict)  # name -> validator(name, value) -> normalized value
    dropped: Callable | None = None


# ----------------------------------------------------------------------------------------------------- selectors

def selector(name: str, value) -> list[int] | str:
    """Validate a layer selector (see SELECTORS) into its canonical form: sorted indices, or "everyN" /
    "everyNfromS" (with S written only where it is not N - 1)."""
    if isinstance(value, str):
        match = _EVERY.fullmatch(value.strip().lower())
        step, start = (int(match[1]), None if match[2] is None else int(match[2])) if match else (0, None)
        if step < 1:
            raise ValueError(f"{name}: {value!r} is not a layer selector; give {SELECTORS}")
        if start is None or start == step - 1:
            return f"every{step}"
        return f"every{step}from{start}"
    if isinstance(value, (list, tuple)) and value:
        bad = [v for v in value if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0]
        if bad:
            raise ValueError(f"{name}: layer indices are integers >= 0 (the first layer is 0), got {bad[0]!r}")
        twice = sorted({int(v) for v in value if list(value).count(v) > 1})
        if twice:
            raise ValueError(f"{name}: layer {twice[0]} is listed twice")
        return sorted(int(v) for v in value)
    raise ValueError(f"{name}: {value!r} is not a layer selector; give {SELECTORS}")


def selected(sel: list[int] | str, n_layers: int, name: str) -> list[int]:
    """The layer indices a canonical selector picks in a model of `n_layers` layers; ValueError naming the layer
    count when it picks a layer the model does not have, or none."""
    if isinstance(sel, list):
        out = sel
    else:
        match = _EVERY.fullmatch(sel)
        assert match is not None  # canonical selectors only
        step = int(match[1])
        out = list(range(step - 1 if match[2] is None else int(match[2]), n_layers, step))
    if not out or out[-1] >= n_layers:
        picked = f"layer {out[-1]}" if out else "no layer"
        raise ValueError(f"{name}: {_show(sel)} selects {picked}, and this model has {n_layers} layers "
                         f"(0-{n_layers - 1})")
    return out


def _show(sel) -> str:
    return "[" + ", ".join(map(str, sel)) + "]" if isinstance(sel, list) else repr(sel)


def selector_text(sel: list[int] | str) -> str:
    """A selector as the spec strings write it: "[3,7,11]" or "every4"."""
    return "[" + ",".join(map(str, sel)) + "]" if isinstance(sel, list) else sel


# -------------------------------------------------------------------------------------------------------- requests

def request(value, registry: Mapping[str, LayerScheme]) -> dict:
    """Validate `layers=`: {per-layer scheme: selector, or {"layers": selector, option: value}}. Canonical form:
    the selector alone where no option is given, so that two requests are equal when they ask the same."""
    if not isinstance(value, dict) or not value:
        raise ValueError(f"layers must be a dict {{scheme: layers}}, e.g. {{'nope': 'every4'}} or {{'p-rope': "
                         f"{{'layers': [0, 1], 'keep': 0.5}}}} (schemes: {', '.join(registry)}); got {value!r}")
    out: dict = {}
    for raw, group in value.items():
        name = raw.strip().lower().replace("_", "-") if isinstance(raw, str) else raw
        if name not in registry:
            raise ValueError(f"layers={{{raw!r}: ...}}: per-layer positions take {', '.join(registry)}; got {raw!r}")
        if name in out:
            raise ValueError(f"layers: {name!r} given twice")
        out[name] = _group(name, group, registry[name])
    seen: dict[int, str] = {}
    for name, group in out.items():  # explicit lists can be checked for overlaps without a model
        sel = group["layers"] if isinstance(group, dict) else group
        for i in sel if isinstance(sel, list) else []:
            if i in seen:
                raise ValueError(f"layers: layer {i} is given both {seen[i]!r} and {name!r}")
            seen[i] = name
    return out


def _group(name: str, group, record: LayerScheme) -> list[int] | str | dict:
    where = f"layers={{{name!r}: ...}}"
    if not isinstance(group, dict):
        return selector(where, group)
    if "layers" not in group:
        raise ValueError(f"{where}: a dict names its layers under 'layers' (and the scheme's options beside it), "
                         f"e.g. {{'layers': 'every4', 'keep': 0.5}}; got {group!r}")
    unknown = sorted(set(group) - {"layers"} - set(record.options))
    if unknown:
        raise ValueError(f"{where} does not take {', '.join(unknown)}; it accepts: "
                         f"{', '.join(sorted(record.options)) or 'no options'}")
    opts = {k: record.options[k](f"{where} {k}", group[k]) for k in sorted(group) if k != "layers"}
    sel = selector(where, group["layers"])
    return {"layers": sel, **opts} if opts else sel


def split(group) -> tuple[list[int] | str, dict]:
    """(selector, options) of one canonical group."""
    if isinstance(group, dict):
        return group["layers"], {k: v for k, v in group.items() if k != "layers"}
    return group, {}


# ------------------------------------------------------------------------------------------------------ the mix-in

@dataclass(frozen=True)
class Override:
    """What one layer's attention receives instead of the rotary module's cos and sin: cos 1, sin 0 on `channels`
    (indices into their last dimension; None: every channel)."""

    scheme: str
    channels: torch.Tensor | None = None

    def apply(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.channels is None:
            return torch.ones_like(cos), torch.zeros_like(sin)
        idx = self.channels.to(cos.device)
        return cos.index_fill(-1, idx, 1.0), sin.index_fill(-1, idx, 0.0)


class LayerPositions:
    """Mixed into a block's class: the block's `position_embeddings` (cos, sin) pass through its Override first."""

    def forward(self, *args, **kwargs):
        pair = kwargs.get("position_embeddings")
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(t, torch.Tensor) for t in pair)):
            raise ValueError(f"{type(self).__name__} has per-layer positions, which change the (cos, sin) pair a "
                             "block receives as position_embeddings=; this block received "
                             f"{type(pair).__name__ if pair is not None else 'none'}")
        kwargs["position_embeddings"] = getattr(self, STATE_ATTR).apply(*pair)
        return super().forward(*args, **kwargs)


# ----------------------------------------------------------------------------------------------------------- apply

def unavailable(model, adapter: Adapter) -> str | None:
    """Why per-layer positions do not apply to this model (None: they may; the patch-time check decides)."""
    if not adapter.has_rope:
        return (f"per-layer positions (layers=) change the RoPE cos/sin each layer's attention receives, and "
                f"{adapter.model_type} has no RoPE")
    if adapter.layers is None or adapter.attention is None:
        return (f"per-layer positions (layers=) change what each block's attention receives, and hfpatch did not find "
                f"{adapter.model_type}'s blocks and their attention ({adapter.notes.get('blocks', '')})")
    try:
        nested = [lt for _, c in rotaries_of(model, adapter) for lt in layer_types(c) if lt is not None]
    except ValueError as e:  # a rotary module without a config to read
        return str(e)
    if len(adapter.rotaries) > 1 or nested:
        return (f"{adapter.model_type} already gives its layers RoPE of their own ("
                + (f"per layer type: {', '.join(sorted(set(nested)))}" if nested else "several rotary modules")
                + "); per-layer positions on top of that are refused (layer_types= chooses the layer types a scaling "
                "applies to)")
    return None


def by_layer(groups: dict, scheme: str, n_layers: int, attention: list[int]) -> list[str | None]:
    """The scheme of every block: `scheme` (the global one), a group's, or None for a block without attention
    (hybrid stacks). ValueError for selectors that do not fit this model, or overlap."""
    out: list[str | None] = [scheme if i in attention else None for i in range(n_layers)]
    taken: dict[int, str] = {}
    for name, group in groups.items():
        sel, _ = split(group)
        for i in selected(sel, n_layers, f"layers={{{name!r}: ...}}"):
            if i in taken:
                raise ValueError(f"layers: layer {i} is selected by both {taken[i]!r} and {name!r}")
            if out[i] is None:
                raise ValueError(f"layers={{{name!r}: ...}}: layer {i} has no attention (this hybrid stack's "
                                 f"attention layers: {', '.join(map(str, attention))})")
            taken[i] = name
            out[i] = name
    return out


def apply_layers(model, adapter: Adapter, req: dict, registry: Mapping[str, LayerScheme], edits: Edits) -> dict:
    """Give the selected layers their schemes (after the global RoPE scheme was applied). Returns the fact
    {"by_layer": [scheme of every block]}."""
    reason = unavailable(model, adapter)
    if reason:
        raise ValueError(reason)
    blocks = get_path(model.base_model, adapter.layers)
    attention = (list(adapter.attention_layers) if adapter.attention_layers is not None
                 else list(range(len(blocks))))
    plan = by_layer(req["layers"], req["scheme"], len(blocks), attention)
    rotary = rotaries_of(model, adapter)[0][0]
    _sin_at_one(rotary)  # the layers get a (cos, sin) pair to change, or a refusal that says they do not
    overrides = {name: _override(name, registry[name], split(group)[1], rotary)
                 for name, group in req["layers"].items()}
    for i, name in enumerate(plan):
        if name in overrides:
            edits.mix_in(blocks[i], LayerPositions)
            edits.set(blocks[i], STATE_ATTR, overrides[name])
    _check(model, adapter, plan, overrides)
    return {"by_layer": plan}


def _override(name: str, record: LayerScheme, opts: dict, rotary) -> Override:
    if record.dropped is None:
        return Override(name)
    inv_freq = rotary.inv_freq
    pairs = record.dropped(inv_freq, opts)
    return Override(name, _channels(rotary, pairs))


def low_frequency_pairs(inv_freq: torch.Tensor, opts: dict) -> list[int]:
    """p-RoPE in a layer: of the pairs the model rotates, all but the highest-frequency floor(keep * n)."""
    n = int(inv_freq.count_nonzero())
    kept = kept_pairs(opts.get("keep", 0.75), n)
    if kept < 1:
        raise ValueError(f"layers={{'p-rope': ...}}: keep={opts.get('keep')} leaves no rotary pair of the {n} this "
                         f"model rotates (it keeps floor(keep * {n})); use keep >= {1 / n:.3g}")
    order = inv_freq.abs().argsort(descending=True, stable=True)
    return [int(i) for i in order[kept:n]]


def _sin_at_one(rotary) -> torch.Tensor:
    """The sin a copy of the rotary module gives position 1 (a copy: transformers' dynamic RoPE updates its module's
    buffers as it runs); ValueError where it does not give the layers a (cos, sin) pair (Llama 4: complex numbers)."""
    module = copy.deepcopy(rotary)
    x = torch.zeros(1, 2, 1, device=module.inv_freq.device)
    with torch.no_grad():
        out = module(x, torch.arange(2, device=x.device)[None])
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        raise ValueError(f"layers=: {type(rotary).__name__} does not hand the layers a (cos, sin) pair (it returns "
                         f"{type(out).__name__}), so per-layer positions cannot change it")
    return out[1][0, 1].float()


def _channels(rotary, pairs: list[int]) -> torch.Tensor:
    """The channels of cos/sin that rotary pairs `pairs` fill, read off a copy of the rotary module run at position
    1 with those pairs' frequencies set to 0 (their sin is then exactly 0, every other rotated channel's is not).
    ValueError where the count is not that of `pairs`' channels."""
    probe = copy.deepcopy(rotary)
    zeroed = probe.inv_freq.clone()
    zeroed[pairs] = 0.0
    for name in ("inv_freq", "original_inv_freq"):
        setattr(probe, name, zeroed.clone())
    sin = _sin_at_one(rotary)
    channels = ((_sin_at_one(probe) == 0) & (sin != 0)).nonzero().flatten()
    # a pair fills two channels (each of its two rotated ones), or one where the family rotates with half-width
    # cos/sin (gpt-oss)
    per_pair = sin.numel() // zeroed.numel()
    if per_pair not in (1, 2) or channels.numel() != per_pair * len(pairs):
        raise ValueError(f"{type(rotary).__name__}: cannot tell which of its cos/sin channels the {len(pairs)} "
                         f"low-frequency pairs fill (found {channels.numel()} channels)")
    return channels.cpu()


def _check(model, adapter: Adapter, plan: list, overrides: dict[str, Override]) -> None:
    """After the mix-ins are in: each changed layer's attention must receive the changed cos/sin, and a NoPE
    layer's attention must no longer tell positions apart (checked as when the whole signal is taken out). Skipped
    on a model without weights yet (a reload builds it on the meta device)."""
    if any(p.device.type == "meta" for p in model.parameters()):
        return
    top = "" if model.base_model is model else model.base_model_prefix + "."
    stack = f"{top}{adapter.layers}"
    probe = probe_run(model, record_interface=False)
    if probe.error:
        raise ValueError(f"layers=: the model with per-layer positions could not run a probe forward: {probe.error}")
    changed = [i for i, name in enumerate(plan) if name in overrides]
    for i in changed:
        path = mixer_paths(stack, adapter.attention, [i])[0]
        call = probe.calls.get(path)
        pair = call.kwargs.get("position_embeddings") if call is not None else None
        override = overrides[plan[i]]
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"layers=: {adapter.model_type}'s attention ({path}) does not take its RoPE as "
                             "position_embeddings=, so per-layer positions cannot change it")
        cos, sin = pair
        idx = override.channels if override.channels is not None else torch.arange(cos.shape[-1])
        if not (bool((cos[..., idx] == 1).all()) and bool((sin[..., idx] == 0).all())):
            raise ValueError(f"layers=: {adapter.model_type}'s attention ({path}) did not receive the per-layer "
                             f"{plan[i]!r} positions its block was given")
    nope = [i for i in changed if overrides[plan[i]].channels is None]
    if nope:
        _, sources = position_sources(model, mixer_paths(stack, adapter.attention, nope), stack)
        if sources:
            raise ValueError(f"layers=: {sources[0]} still tells positions apart with cos 1, sin 0: "
                             f"{adapter.model_type}'s attention has a position signal of its own")

