"""The patch spec: what the user asked for, as plain data, validated before any model is touched.

A spec is a dict with one entry per axis that is patched:
    {"position": {"scheme": "yarn", "factor": 4.0, "beta_fast": 32}, ...}
Only options the user gave are stored, so two specs are equal when the requests are.
"""

from __future__ import annotations

import json
from typing import Any

from .norm.kinds import NORMS
from .norm.placement import PLACEMENTS
from .position import layers
from .position import registry as schemes
from .position.attention import temperature

# The axes of a spec, in the order they are applied (the exact norm conversion needs the blocks as built, and
# position patches go late so that a norm or placement change does not have to redo them). The attention
# temperature comes last: it wraps whatever attention function the position scheme left the model with.
AXES = ("norm", "placement", "position", "temperature")


def position_request(scheme: Any, options: dict) -> dict:
    """Validate a position request against the scheme registry (position/registry.py)."""
    return schemes.request(scheme, options)


def _choice(name: str, value, choices) -> str:
    if not isinstance(value, str) or value.strip().lower() not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}; got {value!r}")
    return value.strip().lower()


def request(position: str | None = None, factor: float | None = None, norm: str | None = None,
            placement: str | None = None, exact: bool | None = None,
            attention_temperature: str | dict[str, Any] | None = None, **options: Any) -> dict:
    """The keyword form of `hfpatch.patch`, validated into a partial spec (only the axes the call names)."""
    out: dict = {}
    if attention_temperature is not None:
        out["temperature"] = temperature.request(attention_temperature)
    if norm is not None:
        if exact is not None and not isinstance(exact, bool):
            raise ValueError(f"exact must be True or False, got {exact!r}")
        out["norm"] = {"kind": _choice("norm", norm, NORMS), "exact": True if exact is None else exact}
    elif exact is not None:
        raise ValueError("exact= only applies together with norm=")
    options = dict(options)
    placement_options = {k: options.pop(k) for k in list(options) if k in all_placement_options()}
    if placement is not None:
        out["placement"] = placement_request(placement, placement_options)
    elif any(v is not None for v in placement_options.values()):
        raise ValueError(f"{', '.join(sorted(placement_options))} given without placement=; name the placement it "
                         "belongs to (placement='mix')")
    if position is None:
        given = sorted(k for k, v in {"factor": factor, **options}.items() if v is not None)
        known = schemes.all_options()
        unknown = [k for k in given if k not in known]
        if unknown:
            raise TypeError(f"patch() got unknown option(s) {', '.join(unknown)}; it accepts position=, factor=, "
                            f"norm=, placement=, exact=, attention_temperature=, the placement options "
                            f"{', '.join(sorted(all_placement_options()))} and the position options "
                            f"{', '.join(sorted(known))}")
        if given:
            raise ValueError(f"{', '.join(given)} given without position=; name the scheme they belong to"
                             + _temperature_hint(given) + _layers_hint(given))
        return out
    out["position"] = position_request(position, {"factor": factor, **options})
    return out


def all_placement_options() -> set[str]:
    return {name for rec in PLACEMENTS.values() for name in rec.options}


def placement_request(placement: Any, options: dict) -> dict:
    """Validate a placement request against the registry (norm/placement.py); only the options given are stored."""
    kind = _choice("placement", placement, PLACEMENTS)
    accepted = PLACEMENTS[kind].options
    out: dict = {"kind": kind}
    for name, value in sorted(options.items()):
        if value is None:
            continue
        if name not in accepted:
            takers = sorted(k for k, rec in PLACEMENTS.items() if name in rec.options)
            raise ValueError(f"placement={kind!r} takes no option {name}; it belongs to placement="
                             f"{' or '.join(repr(k) for k in takers)}")
        out[name] = accepted[name](value)
    return out


def _layers_hint(given: list) -> str:
    if "layers" not in given:
        return ""
    return (" (per-layer positions go with the RoPE scheme of the other layers: position='rope' keeps plain RoPE "
            "there, e.g. position='rope', layers={'nope': 'every4'}, or 'rope+nope@every4' in a spec string)")


def _temperature_hint(given: list) -> str:
    """An option of the attention temperature given as a keyword of its own: say where it goes."""
    theirs = [k for k in given if k in temperature.all_options()]
    if not theirs:
        return ""
    return (f" (the attention temperature's options go with it: attention_temperature={{'kind': ..., "
            f"{theirs[0]!r}: ...}}, or 'logn:{theirs[0]}=...' in a spec string)")


def merge(current: dict, new: dict) -> dict:
    """A new request replaces whole axes and keeps the others: yarn then ntk gives ntk, not both stacked."""
    return {**current, **new}


def parse(text: str) -> dict:
    """The string form used on command lines: "yarn:4", "dynamic", "longrope:4:short_factor=[1,1]",
    "yarn:4:beta_fast=16", "norm=rmsnorm", "yarn:2+norm=layernorm+placement=post",
    "placement=mix+post_fraction=0.5", "yarn:4+attention_temperature=logn",
    "attention_temperature=llama4:floor_scale=4096", per-layer positions "yarn:4+nope@every4",
    "rope+p-rope@[0,1]:keep=0.5". "none" (or "") is the empty spec. Returns `request` keyword
    arguments."""
    text = text.strip()
    if text.lower() in ("", "none"):
        return {}
    kwargs: dict = {}
    for item in text.split("+"):
        key, sep, value = item.partition("=")
        part: dict
        if sep and key.strip() == "attention_temperature":
            part = {"attention_temperature": parse_temperature(value, text)}
        elif sep and key.strip() in all_placement_options() and ":" not in key:
            part = {key.strip(): _number(value.strip(), key.strip(), text)}
        elif sep and key.strip() in ("norm", "placement", "exact") and ":" not in key:
            part = {key.strip(): {"true": True, "false": False}.get(value.strip().lower(), value.strip())}
        elif "@" in item.partition(":")[0]:  # "nope@every4": a per-layer group, gathered into layers=
            name, group = parse_layer_group(item, text)
            if name in kwargs.get("layers", {}):
                raise ValueError(f"in patch spec {text!r}: layers {name!r} given twice")
            kwargs.setdefault("layers", {})[name] = group
            continue
        else:
            part = _parse_position(item.strip(), text)
        twice = sorted(set(part) & set(kwargs))
        if twice:  # "yarn:4+yarn:2": which one was meant? Say so instead of letting the last one win.
            raise ValueError(f"in patch spec {text!r}: {', '.join(twice)} given twice")
        kwargs.update(part)
    return kwargs


def parse_layer_group(item: str, text: str | None = None) -> tuple[str, object]:
    """"nope@every4" -> ("nope", "every4"); "p-rope@[0,1]:keep=0.5" -> ("p-rope", {"layers": [0, 1], "keep": 0.5})
    (values as JSON): a per-layer group of a spec string, or the command's --layers."""
    head, *rest = item.strip().split(":")
    name, _, raw = head.partition("@")
    if not name.strip() or not raw.strip():
        raise ValueError(f"in {text or item!r}: a per-layer group is SCHEME@LAYERS (nope@every4, nope@[3,7,11], "
                         f"p-rope@every2:keep=0.5), got {item.strip()!r}")
    group: dict = {"layers": _json_or_text(raw.strip())}
    for part in rest:
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"in {text or item!r}: expected key=value after {head.strip()!r}, got {part!r}")
        if key.strip() in group:
            raise ValueError(f"in {text or item!r}: {key.strip()} given twice")
        group[key.strip()] = _json_or_text(value)
    return name.strip(), group if len(group) > 1 else group["layers"]


def _json_or_text(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _number(raw: str, key: str, text: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"in patch spec {text!r}: {key} {raw!r} is not a number") from None


def parse_temperature(value: str, text: str | None = None) -> str | dict:
    """"logn" -> "logn"; "logn:window=4096" -> {"kind": "logn", "window": 4096} (values as JSON): the
    attention_temperature= of a spec string, or the command's --attention-temperature."""
    head, *rest = value.strip().split(":")
    if not rest:
        return head.strip()
    out: dict = {"kind": head.strip()}
    for part in rest:
        key, sep, raw = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"in {text or value!r}: expected key=value after the attention temperature's kind, got "
                             f"{part!r}")
        if key.strip() in out:
            raise ValueError(f"in {text or value!r}: {key.strip()} given twice")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def _parse_position(item: str, text: str) -> dict:
    head, *rest = item.split(":")
    kwargs: dict = {"position": head}
    for i, part in enumerate(rest):
        if "=" in part:
            key, _, raw = part.partition("=")
            try:
                value = json.loads(raw)
            except json.JSONDecodeError:
                value = raw
            if key.strip() in kwargs:
                raise ValueError(f"in patch spec {text!r}: {key.strip()} given twice")
            kwargs[key.strip()] = value
        elif i == 0:
            try:
                kwargs["factor"] = float(part)
            except ValueError:
                raise ValueError(f"in patch spec {text!r}: factor {part!r} is not a number") from None
        else:
            raise ValueError(f"in patch spec {text!r}: expected key=value after the factor, got {part!r}")
    return kwargs


def to_kwargs(spec: dict) -> dict:
    """Inverse of `request`: the keyword arguments that rebuild a spec (used when reloading a saved model)."""
    kwargs: dict = {}
    if "norm" in spec:
        kwargs.update(norm=spec["norm"]["kind"], exact=spec["norm"]["exact"])
    if "placement" in spec:
        place = dict(spec["placement"])
        kwargs["placement"] = place.pop("kind")
        kwargs.update(place)
    if "position" in spec:
        pos = dict(spec["position"])
        kwargs["position"] = pos.pop("scheme")
        kwargs.update(pos)
    if "temperature" in spec:
        temp = spec["temperature"]
        kwargs["attention_temperature"] = temp["kind"] if len(temp) == 1 else dict(temp)
    return kwargs


def describe_string(spec: dict) -> str:
    """"yarn:4" style summary of a spec."""
    parts = []
    if "position" in spec:
        pos = spec["position"]
        parts.append(pos["scheme"] + (f":{pos['factor']:g}" if "factor" in pos else ""))
        for name, group in pos.get("layers", {}).items():  # "nope@every4", "p-rope@[0,1]:keep=0.5"
            sel, opts = layers.split(group)
            parts.append(":".join([f"{name}@{layers.selector_text(sel)}",
                                   *(f"{k}={json.dumps(v)}" for k, v in opts.items())]))
    if "norm" in spec:
        parts.append(f"norm={spec['norm']['kind']}" + ("" if spec["norm"]["exact"] else ":inexact"))
    if "placement" in spec:
        parts.append(f"placement={spec['placement']['kind']}")
        parts += [f"{k}={v:g}" for k, v in sorted(spec["placement"].items()) if k != "kind"]
    if "temperature" in spec:
        temp = spec["temperature"]
        parts.append("attention_temperature=" + ":".join([temp["kind"], *(f"{k}={json.dumps(v)}" for k, v in
                                                                          temp.items() if k != "kind")]))
    return "+".join(parts) or "none"
