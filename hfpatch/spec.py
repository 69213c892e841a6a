"""The patch spec: what the user asked for, as plain data, validated before any model is touched.

A spec is a dict with one entry per axis that is patched:
    {"position": {"scheme": "yarn", "factor": 4.0, "beta_fast": 32}, ...}
Only options the user gave are stored, so two specs are equal when the requests are.
"""

from __future__ import annotations

import math
import numbers

from .position import SCHEMES, options_of

AXES = ("position", "norm", "placement")


def position_schemes() -> list[str]:
    return list(SCHEMES)


def _number(name: str, value, *, positive=True, above_one=False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if above_one and value <= 1.0:
        raise ValueError(f"{name} must be > 1 (it is the context extension ratio), got {value:g}")
    if positive and value <= 0.0:
        raise ValueError(f"{name} must be > 0, got {value:g}")
    return value


def _check_option(name: str, value):
    """Type/range checks that need no model. Model-dependent ones (list lengths, layer types) are in apply.py."""
    if name == "factor":
        return _number("factor", value, above_one=True)
    if name == "original_max_position_embeddings":
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
            raise ValueError(f"original_max_position_embeddings must be a positive integer, got {value!r}")
        return int(value)
    if name in ("short_factor", "long_factor"):
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
            raise ValueError(f"{name} must be a list of numbers (one per rotary frequency), got {value!r}")
        return [_number(f"{name}[{i}]", v) for i, v in enumerate(value)]
    if name == "truncate":
        if not isinstance(value, bool):
            raise ValueError(f"truncate must be True or False, got {value!r}")
        return value
    if name == "layer_types":
        if isinstance(value, str):
            value = [value]
        if not value or not all(isinstance(v, str) for v in value):
            raise ValueError(f"layer_types must be a non-empty list of layer type names, got {value!r}")
        return sorted(set(value))
    if name in ("mscale", "mscale_all_dim"):
        return _number(name, value, positive=False)
    return _number(name, value)  # attention_factor, beta_*, *_freq_factor: positive numbers


def position_request(scheme, options: dict) -> dict:
    """Validate a position request: {"scheme": ..., **options} or ValueError/TypeError saying what is accepted."""
    if not isinstance(scheme, str):
        raise TypeError(f"position must be a string, one of {', '.join(position_schemes())}; got {scheme!r}")
    name = scheme.strip().lower().replace("_", "-")
    if name not in SCHEMES:
        hint = ""
        if ":" in name or "+" in name or "=" in name:
            hint = " (a spec string such as 'yarn:4' is for the command line; in Python pass position='yarn', " \
                   "factor=4, or hfpatch.patch(model, **hfpatch.spec.parse('yarn:4')))"
        raise ValueError(f"unknown position scheme {scheme!r}; valid: {', '.join(position_schemes())}{hint}")
    info = SCHEMES[name]
    options = {k: v for k, v in options.items() if v is not None}
    allowed = options_of(name)
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(
            f"position={name!r} does not take {', '.join(unknown)}; it accepts: {', '.join(sorted(allowed)) or 'no options'}"
        )
    if info.factor == "required" and options.get("factor") is None:
        raise ValueError(f"position={name!r} needs factor= (a finite number > 1, the context extension ratio)")
    out = {"scheme": name}
    for key in sorted(options):
        out[key] = _check_option(key, options[key])
    if name in ("yarn", "dynamic-yarn") and "beta_fast" in out and "beta_slow" in out:
        if out["beta_fast"] <= out["beta_slow"]:
            raise ValueError(f"beta_fast must be greater than beta_slow, got {out['beta_fast']} <= {out['beta_slow']}")
    if name == "llama3":
        lo, hi = out.get("low_freq_factor", 1.0), out.get("high_freq_factor", 4.0)
        if hi <= lo:
            raise ValueError(f"high_freq_factor must be greater than low_freq_factor, got {hi} <= {lo}")
    if name == "longrope":
        missing = [k for k in ("short_factor", "long_factor") if k not in out]
        if missing:
            raise ValueError(
                f"position='longrope' needs {' and '.join(missing)}: lists of per-frequency scale factors "
                "(rotary_dim / 2 numbers each)"
            )
    return out


NORMS = ("rmsnorm", "layernorm")
PLACEMENTS = ("pre", "post")


def _choice(name: str, value, choices) -> str:
    if not isinstance(value, str) or value.strip().lower() not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}; got {value!r}")
    return value.strip().lower()


def request(position=None, factor=None, norm=None, placement=None, exact=None, **options) -> dict:
    """The keyword form of `hfpatch.patch`, validated into a partial spec (only the axes the call names)."""
    out: dict = {}
    if norm is not None:
        if exact is not None and not isinstance(exact, bool):
            raise ValueError(f"exact must be True or False, got {exact!r}")
        out["norm"] = {"kind": _choice("norm", norm, NORMS), "exact": True if exact is None else exact}
    elif exact is not None:
        raise ValueError("exact= only applies together with norm=")
    if placement is not None:
        out["placement"] = {"kind": _choice("placement", placement, PLACEMENTS)}
    if position is None:
        given = sorted(k for k, v in {"factor": factor, **options}.items() if v is not None)
        known = set().union(*(options_of(s) for s in SCHEMES))
        unknown = [k for k in given if k not in known]
        if unknown:
            raise TypeError(f"patch() got unknown option(s) {', '.join(unknown)}; it accepts position=, factor=, "
                            f"norm=, placement=, exact= and the position options {', '.join(sorted(known))}")
        if given:
            raise ValueError(f"{', '.join(given)} given without position=; name the scheme they belong to")
        return out
    out["position"] = position_request(position, {"factor": factor, **options})
    return out


def merge(current: dict, new: dict) -> dict:
    """A new request replaces whole axes and keeps the others: yarn then ntk gives ntk, not both stacked."""
    return {**current, **new}


def parse(text: str) -> dict:
    """The string form used on command lines: "yarn:4", "dynamic", "longrope:4:short_factor=[1,1]",
    "yarn:4:beta_fast=16", "norm=rmsnorm", "yarn:2+norm=layernorm+placement=post". "none" (or "") is the empty
    spec. Returns `request` keyword arguments."""
    text = text.strip()
    if text.lower() in ("", "none"):
        return {}
    kwargs: dict = {}
    for item in text.split("+"):
        key, sep, value = item.partition("=")
        if sep and key.strip() in ("norm", "placement", "exact") and ":" not in key:
            part = {key.strip(): {"true": True, "false": False}.get(value.strip().lower(), value.strip())}
        else:
            part = _parse_position(item.strip(), text)
        twice = sorted(set(part) & set(kwargs))
        if twice:  # "yarn:4+yarn:2": which one was meant? Say so instead of letting the last one win.
            raise ValueError(f"in patch spec {text!r}: {', '.join(twice)} given twice")
        kwargs.update(part)
    return kwargs


def _parse_position(item: str, text: str) -> dict:
    import json

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
        kwargs["placement"] = spec["placement"]["kind"]
    if "position" in spec:
        pos = dict(spec["position"])
        kwargs["position"] = pos.pop("scheme")
        kwargs.update(pos)
    return kwargs


def describe_string(spec: dict) -> str:
    """"yarn:4" style summary of a spec."""
    parts = []
    if "position" in spec:
        pos = spec["position"]
        parts.append(pos["scheme"] + (f":{pos['factor']:g}" if "factor" in pos else ""))
    if "norm" in spec:
        parts.append(f"norm={spec['norm']['kind']}" + ("" if spec["norm"]["exact"] else ":inexact"))
    if "placement" in spec:
        parts.append(f"placement={spec['placement']['kind']}")
    return "+".join(parts) or "none"
