"""GGUF in, GGUF out: a RoPE patch written as llama.cpp's own RoPE metadata, and read back from it.

    hfpatch.interop.gguf.export("model.gguf", "model-yarn4.gguf", position="yarn", factor=4)
    hfpatch patch model.gguf --position yarn --factor 4 --out model-yarn4.gguf

`export` copies a GGUF file with every tensor byte for byte and rewrites only what llama.cpp reads about RoPE
scaling: `{arch}.rope.scaling.*`, `{arch}.rope.freq_base` (NTK-aware), `{arch}.context_length`, and the per-frequency
tensors (`rope_freqs` for Llama 3.1's scaling, `rope_factors_long` / `rope_factors_short` for LongRoPE). The numbers
come from hfpatch's own builders (position/rope/builders.py) and transformers' RoPE functions, exactly as
`hfpatch.patch` computes them in memory, so the defaults (YaRN's attention factor and betas, the original window)
are the same.

The file also carries `hfpatch.record` (JSON: the spec and the original base and window), so that `read_patch` /
`hfpatch.models.load` give back exactly the patched model in transformers, whose GGUF loader reads only
`rope.freq_base`. Without the record (a GGUF made elsewhere) the scheme is read from llama.cpp's metadata itself.
An export from a file that carries the record starts from the base and window it holds, so that exporting again
gives the file the original would have given; a scaling made elsewhere is replaced, its base kept with a warning.

The output is written whole or not at all (a temporary file next to it, synced and renamed); an existing output is
replaced only when asked (overwrite=True) and only if it is a GGUF file (gguf_file.py: the file-level reading and
writing, which knows nothing of RoPE).

What llama.cpp cannot express is refused with the reason: schemes that are not RoPE frequencies (ALiBi, T5, XL,
learned tables, NoPE, ...), frequencies that follow the sequence length (dynamic NTK, dynamic YaRN), norm and
placement swaps. Self-Extend is a run-time setting of llama.cpp, not metadata: the refusal names the flags.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import apply
from .. import spec as specs
from ..adapters import adapter_for
from ..edits import Edits
from ..position.registry import SCHEMES
from ..position.rope import builders
from ..position.rope import rotary as rot
from ..position.rope.llamacpp import DEFAULT_SCALING_TYPE, TENSORS, Gguf, Refusal
from ..position.signal import max_positions, rotaries_of
from .gguf_file import MAGIC as MAGIC  # importable from here too
from .gguf_file import check_output, field_value, open_gguf, write_copy
from .gguf_file import is_gguf as is_gguf  # importable from here too

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# ------------------------------------------------------------------------------------------ llama.cpp, as data
# Read off llama.cpp's source (src/llama-model.cpp, src/llama-context.cpp, src/models/*.cpp) as vendored by
# llama-cpp-python 0.3.36.

DEFAULT_FREQ_BASE = 10000.0  # llama.cpp's value when a file names none

RECORD_KEY = "hfpatch.record"
RECORD_VERSION = 1

# The keys under {arch}. that describe a RoPE scaling: an export replaces all of them (a new scheme replaces the
# old one, as `hfpatch.patch` does), so none of the source's scaling is left to combine with the new one.
SCALING_KEYS = ("rope.scaling.type", "rope.scaling.factor", "rope.scale_linear", "rope.scaling.attn_factor",
                "rope.scaling.original_context_length", "rope.scaling.yarn_ext_factor",
                "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow")


# Why a scheme that changes more than RoPE's frequencies cannot go into a GGUF, where its record names no reason
_NOT_ROPE = ("changes the model's position encoding beyond its RoPE frequencies, which llama.cpp reads from no "
             "metadata (a GGUF export copies the weights and rewrites only RoPE metadata)")


# ------------------------------------------------------------------------------------------------- the source

@dataclass
class RopeInfo:
    """What a GGUF file says about its RoPE."""

    arch: str
    freq_base: float
    context_length: int
    window: int  # the trained window: rope.scaling.original_context_length, else context_length
    n_rot: int  # rotated channels per head
    keys: dict = field(default_factory=dict)  # {key without the "{arch}." prefix: value} of SCALING_KEYS present
    tensors: dict = field(default_factory=dict)  # {name: float64 array} of the RoPE tensors present
    record: dict | None = None


def read_rope(reader: Any) -> RopeInfo:
    """The RoPE facts of an open GGUFReader; ValueError when the file names no RoPE."""
    arch = field_value(reader, "general.architecture")
    if not arch:
        raise ValueError("the GGUF file names no general.architecture")
    pre = f"{arch}."
    base = field_value(reader, pre + "rope.freq_base")
    dims = field_value(reader, pre + "rope.dimension_count")
    if base is None and dims is None:
        raise ValueError(f"this GGUF ({arch}) has no RoPE ({pre}rope.freq_base / {pre}rope.dimension_count): RoPE "
                         "schemes apply to RoPE models")
    ctx = field_value(reader, pre + "context_length")
    if not ctx:
        raise ValueError(f"this GGUF ({arch}) names no {pre}context_length (the trained window)")
    if dims is None:
        heads = field_value(reader, pre + "attention.head_count")
        key_length = field_value(reader, pre + "attention.key_length")
        embd = field_value(reader, pre + "embedding_length")
        if isinstance(heads, list):  # per-layer head counts
            heads = max(heads)
        dims = key_length or (embd // heads if embd and heads else None)
        if not dims:
            raise ValueError(f"this GGUF ({arch}) does not say how many channels RoPE rotates")
    keys = {k: field_value(reader, pre + k) for k in SCALING_KEYS if reader.get_field(pre + k) is not None}
    tensors = {t.name: np.asarray(t.data, dtype=np.float64).reshape(-1) for t in reader.tensors
               if t.name in TENSORS.values()}
    record = field_value(reader, RECORD_KEY)
    return RopeInfo(arch, float(DEFAULT_FREQ_BASE if base is None else base), int(ctx),
                    int(keys.get("rope.scaling.original_context_length") or ctx), int(dims), keys, tensors,
                    json.loads(record) if record else None)


# ---------------------------------------------------------------------------------------- the scheme, as numbers


@dataclass
class Plan:
    """What an export writes: metadata keys (without the "{arch}." prefix unless `absolute`) and RoPE tensors."""

    keys: dict  # {key: (value, "f32" | "u32" | "str")}
    tensors: dict  # {tensor name: float32 array}
    spec: dict
    n_positions: int


def _f32(x: Any) -> float:
    return float(np.float32(x))


def exportable() -> list[str]:
    """The schemes a GGUF can carry: those whose record names a llama.cpp form."""
    return [name for name, scheme in SCHEMES.items() if scheme.gguf is not None]


def refusal(name: str, req: dict | None = None, trained_window: Callable[[], int] | None = None) -> str | None:
    """Why position=`name` cannot go into a GGUF (None: it can). With the validated request and the source's trained
    window (called only when the reason depends on it), the reason names the settings to run instead."""
    scheme = SCHEMES[name]
    if scheme.gguf is not None:
        return None
    reason = scheme.gguf_refusal
    if isinstance(reason, Refusal):
        return reason.general if req is None or trained_window is None else reason.given(req, trained_window())
    return reason or f"{scheme.summary}: it {_NOT_ROPE}"


def request(position: str | None = None, factor: float | None = None, *,
            trained_window: Callable[[], int] | None = None, **options: Any) -> dict:
    """The validated position request of an export, or ValueError saying why a GGUF cannot carry it.
    `trained_window` gives the source's trained window, for the refusals that name settings following it."""
    req = specs.request(position=position, factor=factor, **options)
    if "temperature" in req:
        raise ValueError("attention_temperature= has no GGUF form: llama.cpp reads a temperature only from a Llama 4 "
                         "model's own metadata, for its NoPE layers")
    other = [axis for axis in req if axis != "position"]
    if other:
        verb = "changes" if len(other) == 1 else "change"
        raise ValueError(f"{'= and '.join(other)}= {verb} the model's blocks, which a GGUF export does not touch (it "
                         "copies the weights byte for byte and rewrites only RoPE metadata); llama.cpp runs its "
                         "architectures' own norms")
    if "position" not in req:
        raise ValueError("nothing to export: give position= (one of " + ", ".join(exportable()) + ")")
    pos = req["position"]
    reason = refusal(pos["scheme"], pos, trained_window)
    if reason:
        raise ValueError(f"position={pos['scheme']!r} cannot be written to a GGUF file: {reason}")
    if "layers" in pos:
        raise ValueError("layers= has no GGUF form: llama.cpp reads per-layer NoPE only from a Llama 4 model's own "
                         "metadata, and no per-layer p-RoPE at all")
    if "layer_types" in pos:
        raise ValueError("layer_types= has no GGUF form: llama.cpp scales the RoPE of the global-attention layers "
                         "of a sliding-window model and leaves the local ones")
    return pos


def plan(info: RopeInfo, pos: dict) -> Plan:
    """The metadata and tensors that carry position request `pos` (validated) for the model `info` describes."""
    name = pos["scheme"]
    opts = {k: v for k, v in pos.items() if k not in ("scheme", "layer_types", "layers",
                                                      "original_max_position_embeddings")}
    window = pos.get("original_max_position_embeddings") or info.window
    base = {"rope_type": "default", "rope_theta": info.freq_base}
    scheme = SCHEMES[name]
    assert scheme.rope is not None and scheme.gguf is not None, name  # request() refused the others
    params = scheme.rope(base, window, opts, info.n_rot)
    n_positions = max_positions(scheme, window, opts) or window
    keys, tensors = scheme.gguf.write(info, params, opts, n_positions)
    # rope.freq_base always: the base the scheme was computed from (NTK's raised one), never one a source carried
    keys = {"context_length": (n_positions, "u32"), "rope.scaling.original_context_length": (window, "u32"),
            "rope.freq_base": (params["rope_theta"], "f32"), **keys}
    return Plan(keys, tensors, {"position": pos}, n_positions)


# ------------------------------------------------------------------------------------------------------ writing

def export(src: Path | str, out: Path | str, position: str | None = None, factor: float | None = None, *,
           overwrite: bool = False, **options: Any) -> dict:
    """Copy GGUF file `src` to `out` with the RoPE metadata of the position scheme (the keyword arguments of
    `hfpatch.patch`). Every tensor is copied byte for byte; the source's own RoPE scaling is replaced, and a file
    hfpatch exported gets its original base back first, so the result is the export from the original file. An
    existing `out` is replaced only with overwrite=True, and only if it is a GGUF file. Returns what was written:
    {"spec", "metadata": {full key: value}, "tensors": [names], "context_length"}."""
    import gguf  # an optional extra (hfpatch[gguf])

    src, out = os.fspath(src), os.fspath(out)
    if not os.path.isfile(src):
        raise ValueError(f"no such GGUF file: {src}")
    check_output(out, src, overwrite)
    # bad input costs no file reading, except for a refusal that names settings following the trained window
    pos = request(position=position, factor=factor, trained_window=lambda: read_rope(open_gguf(src)).window,
                  **options)
    reader = open_gguf(src)
    info = read_rope(reader)
    if reader.get_field(f"{info.arch}.rope.scaling.yarn_log_multiplier") is not None:
        raise ValueError(f"this {info.arch} GGUF's YaRN also enters its attention scale (rope.scaling."
                         "yarn_log_multiplier), which hfpatch does not rewrite")
    original = original_rope(info, src)
    p = plan(original, pos)
    record = {"version": RECORD_VERSION, "spec": p.spec, "rope_theta": original.freq_base, "window": original.window}
    keys = {f"{info.arch}.{k}": v for k, v in p.keys.items()}
    keys[RECORD_KEY] = (json.dumps(record, sort_keys=True), "str")
    # the scaling keys and the record go and are written after the model's own keys, so the file is the same
    # whatever scaling the source carried: the export of the original file
    drop = {f"{info.arch}.{k}" for k in SCALING_KEYS} | {RECORD_KEY}
    write_copy(gguf, reader, out, keys, drop, p.tensors, set(TENSORS.values()))
    return {"spec": p.spec, "metadata": {k: v for k, (v, _) in keys.items()}, "tensors": sorted(p.tensors),
            "context_length": p.n_positions}


def original_rope(info: RopeInfo, path: str) -> RopeInfo:
    """The RoPE of the model before any scaling the file carries: what an export starts from. A file hfpatch
    exported records its original base and window; a scaling made elsewhere gets a warning, as its base (which NTK
    scaling raises) cannot be told from the model's own and is kept."""
    found = _from_record(info) if info.record is not None else None
    if found is not None:
        return RopeInfo(info.arch, found.rope_theta, found.window, found.window, info.n_rot)
    scaled = scaling_carried(info)
    if scaled:
        stale = " (its hfpatch record no longer matches its metadata)" if info.record is not None else ""
        warnings.warn(f"{path} carries a RoPE scaling that hfpatch did not export{stale}: {', '.join(scaled)}. The "
                      f"export replaces it, and keeps rope.freq_base = {info.freq_base:g} and the trained window "
                      f"{info.window} as the model's own; if another tool raised that base (NTK scaling), export from "
                      "the original file instead", UserWarning, stacklevel=3)
    return RopeInfo(info.arch, info.freq_base, info.window, info.window, info.n_rot)


def scaling_carried(info: RopeInfo) -> list[str]:
    """What in the file's metadata says it carries a RoPE scaling (["key=value", tensor names...]; [] for none)."""
    k = info.keys
    found = [f"rope.scaling.type={k['rope.scaling.type']}"] if k.get("rope.scaling.type", "none") != "none" else []
    found += [f"{key}={k[key]:g}" for key in ("rope.scaling.factor", "rope.scale_linear") if k.get(key) not in
              (None, 0.0, 1.0)]
    if info.context_length != info.window:  # an extended window over the trained one
        found.append(f"context_length={info.context_length} over rope.scaling.original_context_length={info.window}")
    return found + sorted(info.tensors)


# ------------------------------------------------------------------------------------------------------ reading

@dataclass
class Found:
    """The RoPE a GGUF file describes, in hfpatch's terms: the original base and window (what transformers' own
    GGUF loader should have built) and the patch on top (hfpatch.patch keyword arguments, None for plain RoPE)."""

    rope_theta: float
    window: int
    patch: dict | None
    source: str  # "record" | "metadata"


def read_patch(path: Path | str) -> Found | None:
    """The RoPE scaling a GGUF file carries, or None when it carries none (plain RoPE as transformers loads it)."""
    path = os.path.realpath(os.fspath(path))
    st = os.stat(path)
    # the inode and ctime too: a file copied over another with its times kept (cp -p) has the old size and mtime,
    # but every write changes the ctime
    return copy.deepcopy(_read_patch(path, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)))


@functools.lru_cache(maxsize=16)
def _read_patch(path: str, version: tuple) -> Found | None:
    """read_patch, once per version of a file (`version`: its stat): parsing a GGUF's metadata (its vocabulary)
    takes seconds."""
    reader = open_gguf(path)
    try:
        info = read_rope(reader)
    except ValueError:
        return None  # no RoPE: nothing for hfpatch to read
    if info.record is not None:
        found = _from_record(info)
        if found is not None:
            return found
        warnings.warn(f"{path}: the RoPE metadata no longer matches the hfpatch record it carries (edited after "
                      "export?); reading llama.cpp's metadata instead", stacklevel=2)
    return _from_metadata(info)


def _from_record(info: RopeInfo) -> Found | None:
    """The record's spec, if exporting it from the recorded base gives the metadata the file holds."""
    rec = info.record
    if not isinstance(rec, dict) or rec.get("version") != RECORD_VERSION or "spec" not in rec:
        return None
    base = RopeInfo(info.arch, float(rec["rope_theta"]), int(rec["window"]), int(rec["window"]), info.n_rot)
    try:
        pos = rec["spec"]["position"]
        expected = plan(base, pos)
    except (KeyError, TypeError, ValueError):
        return None
    now = {"context_length": info.context_length, "rope.freq_base": info.freq_base, **info.keys}
    for key, (value, _) in expected.keys.items():
        have = now.get(key)
        if have is None or (isinstance(value, str) and have != value) or \
                (not isinstance(value, str) and not math.isclose(_f32(value), _f32(have), rel_tol=1e-6)):
            return None
    if set(expected.tensors) != set(info.tensors) or any(
            not np.allclose(info.tensors[n], expected.tensors[n], rtol=1e-6, atol=0) for n in expected.tensors):
        return None
    return Found(base.freq_base, base.window, specs.to_kwargs({"position": pos}), "record")


def _from_metadata(info: RopeInfo) -> Found | None:
    """llama.cpp's own reading of the scaling keys and tensors, as an hfpatch patch (a GGUF made elsewhere): the
    first scheme record whose GGUF reader recognises the file (position/rope/llamacpp.py says in which order)."""
    kind = info.keys.get("rope.scaling.type", DEFAULT_SCALING_TYPE)
    for name, forms in readers(kind):
        assert forms.read is not None  # readers() gives the forms that read
        options = forms.read(info)
        if options is None:
            continue
        return Found(info.freq_base, info.window, {"position": name, **options}, "metadata") if options else None
    return None


def readers(scaling_type: str) -> list[tuple[str, Gguf]]:
    """(scheme, its GGUF forms) of the schemes whose records read a GGUF file, in the order a file of this
    rope.scaling.type is tried: those of that type, then those that read tensors whatever the type."""
    forms = [(name, s.gguf) for name, s in SCHEMES.items() if s.gguf is not None and s.gguf.read is not None]
    return [f for f in forms if f[1].scaling_type == scaling_type] + [f for f in forms if f[1].scaling_type is None]


def apply_to_loaded(model: PreTrainedModel, path: Path | str) -> None:
    """After transformers loaded GGUF file `path` (reading only rope.freq_base and context_length), make the model
    the one the file describes: the original base and window, then the recorded or read patch."""
    apply_found(model, read_patch(path), path)


def apply_found(model: PreTrainedModel, found: Found | None, path: Path | str) -> None:
    """apply_to_loaded with the file's RoPE already read (`found`: what read_patch gave for `path`)."""
    if found is None:
        return
    target = apply.unwrap(model)
    config = target.config.get_text_config()
    params = dict(config.rope_parameters)
    if "rope_type" not in params:  # a config nested per layer type: transformers' GGUF loader builds none
        raise ValueError(f"{path}: per-layer-type RoPE is not read from GGUF files")
    config.rope_parameters = {**builders.plain(params, found.window, {}, 0), "rope_theta": found.rope_theta}
    config.max_position_embeddings = found.window
    for rotary, rcfg in rotaries_of(target, adapter_for(target)):
        rot.rebuild(rotary, rcfg, Edits())  # this is the original model: nothing to undo
    if found.patch:
        apply.patch(target, **found.patch)
