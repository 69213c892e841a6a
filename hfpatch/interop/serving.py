"""What serving engines read of a saved checkpoint's RoPE: the warnings of `hfpatch describe` on a saved folder and
the table of docs/serving.md both come from `ROPE_READERS` below (one `RopeReader` per serving engine), which gathers
what each scheme record says of its saved form (`serving=`, position/rope/serving.py).

A checkpoint that hfpatch saves carries its RoPE in transformers' own `rope_parameters` (config.json), which
transformers reloads exactly. vLLM and SGLang build their rotary embeddings from the same dict, but each reads its own
list of keys for a rope_type and computes the attention factor (the cos/sin magnitude of YaRN and LongRoPE) its own
way; where that gives another number than transformers, the engine serves a different model. Where an engine key
exists that makes it serve the model as transformers does (LongRoPE's `short_mscale` / `long_mscale`, which vLLM and
SGLang read in place of `attention_factor`), `hfpatch.save_pretrained` writes it beside transformers' own keys
(`serving_keys`); what no key can fix, it says (`differences`).
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field

from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ..position.registry import SCHEMES
from ..position.rope.serving import ENGINES, Serving
from ..registry import Derived


@dataclass(frozen=True)
class RopeReader:
    """How one serving engine reads a saved checkpoint's RoPE (its config.json), gathered from the scheme records."""

    source: str
    reads: dict  # rope_type -> the rope_parameters keys the engine reads for it
    # rope_type -> ((rope_parameters, max_position_embeddings) -> the cos/sin magnitude the engine applies, how)
    attention: dict = field(default_factory=dict)
    behaviour: dict = field(default_factory=dict)  # rope_type -> how the engine's scheme differs beyond its keys
    # rope_types the engine serves as transformers does only up to the trained window (its behaviour says why)
    window_only: tuple = ()
    # rope_types whose `factor` multiplies max_position_embeddings in the longest sequence the engine serves (for the
    # others, max_position_embeddings is already the extended window, as transformers reads it)
    window_factor: tuple = ()


def saved_forms() -> dict[str, Serving]:
    """rope_type -> what the engines read of it, from the scheme records (in registry order; the schemes saved as one
    rope_type share its form)."""
    forms: dict[str, Serving] = {}
    for scheme in SCHEMES.values():
        if scheme.serving is not None:
            forms.setdefault(scheme.serving.rope_type, scheme.serving)
    return forms


def _reader(engine: str) -> RopeReader:
    read = {kind: form.engines[engine] for kind, form in saved_forms().items() if engine in form.engines}
    return RopeReader(ENGINES[engine], reads={kind: r.reads for kind, r in read.items()},
                      attention={kind: r.attention for kind, r in read.items() if r.attention},
                      behaviour={kind: r.behaviour for kind, r in read.items() if r.behaviour},
                      window_only=tuple(kind for kind, r in read.items() if r.window_only),
                      window_factor=tuple(kind for kind, r in read.items() if r.window_factor))


ROPE_READERS: Derived[RopeReader] = Derived(lambda: {engine: _reader(engine) for engine in ENGINES})


def _checked() -> tuple[str, ...]:
    """The rope_parameters keys of a scaling scheme that an engine may not read (the ones every engine reads are
    left out): every key transformers reads for a saved scheme."""
    return tuple(dict.fromkeys(k for form in saved_forms().values() for k in form.transformers))


def transformers_attention(config, layer_type=None) -> float:
    """The cos/sin magnitude transformers applies for a config's RoPE (its own RoPE functions)."""
    params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
    if params["rope_type"] not in ROPE_INIT_FUNCTIONS:
        return 1.0
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    return float(ROPE_INIT_FUNCTIONS[params["rope_type"]](config, None, **kwargs)[1])


def differences(config) -> list[str]:
    """Where each known engine serves this config's RoPE differently from transformers (empty: the same)."""
    config = config.get_text_config()
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        return []
    nested = "rope_type" not in params
    checked, readers = _checked(), dict(ROPE_READERS)
    out = []
    for layer_type, p in (params.items() if nested else [(None, params)]):
        if not isinstance(p, dict) or p.get("rope_type") in (None, "default"):
            continue
        where = f" ({layer_type} layers)" if layer_type else ""
        kind = p["rope_type"]
        for name, engine in readers.items():
            if kind not in engine.reads:
                out.append(f"{name} has no rope_type {kind!r}{where}")
                continue
            unread = [k for k in checked if k in p and k not in engine.reads[kind]]
            fn, _ = engine.attention.get(kind, (None, None))
            if fn is not None:
                theirs = fn(p, config.max_position_embeddings)
                ours = transformers_attention(config, layer_type)
                if not math.isclose(theirs, ours, rel_tol=1e-6):
                    keys = f" (it does not read {', '.join(unread)})" if unread else ""
                    out.append(f"{name} applies a {kind} attention factor of {theirs:.6g}, transformers "
                               f"{ours:.6g}{where}{keys}")
            if kind in engine.behaviour:
                out.append(f"{name} {kind}{where}: {engine.behaviour[kind]}")
    return out


# rope_type -> the engine keys that carry the attention factor (cos/sin magnitude) in place of transformers'
# attention_factor: vLLM and SGLang read LongRoPE's from these, and compute another default without them
ATTENTION_KEYS: Derived[tuple[str, ...]] = Derived(lambda: {kind: form.attention_keys for kind, form in
                                                            saved_forms().items() if form.attention_keys})


def longest_served(engine: str, config) -> int | None:
    """The longest sequence (prompt and generated tokens) `engine` serves for a config (vLLM refuses a longer
    max_model_len, and its RoPE tables end there); None where the config does not say."""
    config = config.get_text_config()
    window = getattr(config, "max_position_embeddings", None)
    params = getattr(config, "rope_parameters", None)
    if window is None or not isinstance(params, dict):
        return window
    if params.get("rope_type") in ROPE_READERS[engine].window_factor:
        return int(window * float(params.get("factor") or 1.0))
    return int(window)


def serving_keys(config) -> dict:
    """The engine keys to write beside transformers' own in a flat `rope_parameters`, so that the engines serve the
    RoPE with the attention factor transformers computes; {} where none is needed."""
    params = getattr(config, "rope_parameters", None)
    keys = ATTENTION_KEYS.get(str(params.get("rope_type")), ()) if isinstance(params, dict) else ()
    if not keys:
        return {}
    factor = transformers_attention(config)
    return dict.fromkeys(keys, factor)


def folder_differences(path) -> list[str]:
    """`differences` of the config.json in a saved folder (what an engine reads), or [] for anything else."""
    if not (os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))):
        return []
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError):
        return []
    out = differences(config)
    record = getattr(config, "hfpatch", None)
    spec = record.get("spec", {}) if isinstance(record, dict) else {}
    if "position" in spec:
        scheme = spec["position"].get("scheme")
        if scheme in SCHEMES and not SCHEMES[scheme].native:
            out.append(f"position={scheme!r} is not in config.json's own terms: every engine but hfpatch serves the "
                       "model's original position encoding")
        elif spec["position"].get("layers"):
            out.append(f"per-layer positions ({', '.join(spec['position']['layers'])} in some layers) are not in "
                       "config.json's own terms: every engine but hfpatch serves the model's original position "
                       "encoding in every layer")
    if "temperature" in spec:
        out.append(f"attention_temperature={spec['temperature'].get('kind')!r} is not in config.json's own terms: "
                   "every engine but hfpatch serves the model without it")
    return out


# ------------------------------------------------------------------------------------------------- the docs table

def saved_rope_types() -> dict[str, str]:
    """hfpatch scheme -> the rope_type it saves, for the native RoPE rescalings that take a factor: what each
    record's saved form names."""
    return {name: scheme.serving.rope_type for name, scheme in SCHEMES.items()
            if scheme.serving is not None and scheme.native and scheme.factor != "none"}


def markdown() -> str:
    """The tables of docs/serving.md: the keys each engine does not read, per saved scheme, and how each engine
    computes the attention factor or runs a scheme differently."""
    rows = []
    forms, readers = saved_forms(), dict(ROPE_READERS)
    for scheme, kind in saved_rope_types().items():
        transformers_keys = forms[kind].transformers
        cells = [f"`{scheme}`", f"`{kind}`", ", ".join(f"`{k}`" for k in transformers_keys) or "(theta only)"]
        for engine in readers.values():
            reads = engine.reads.get(kind, ())
            cells.append(", ".join(f"`{k}`" for k in transformers_keys if k not in reads) or "-")
        rows.append(cells)
    keys = markdown_table(["hfpatch scheme", "rope_type", "transformers reads", *(f"{e} does not read"
                                                                                  for e in ROPE_READERS)], rows)
    rows = []
    for name, engine in readers.items():
        for kind, (_, how) in engine.attention.items():
            rows.append([name, f"`{kind}`", f"attention factor (cos/sin magnitude) = {how}"])
        for kind, how in engine.behaviour.items():
            rows.append([name, f"`{kind}`", how])
    return keys + "\n\n" + markdown_table(["engine", "rope_type", "what it does"], rows)


def markdown_table(header: list, rows: list[list]) -> str:
    # the evaluations' table helper lives above this layer (evaluate/report.py, with matplotlib); this is the same
    lines = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def main(argv=None) -> int:
    """python -m hfpatch.interop.serving [FOLDER]: the docs table, or a saved folder's differences."""
    argv = sys.argv[1:] if argv is None else argv
    if argv:
        print(json.dumps(folder_differences(argv[0]), indent=2))
    else:
        print(markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
