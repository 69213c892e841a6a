"""What applies to every causal-LM family of the installed transformers, measured: each model type is built as a
tiny random model from its own config class (hfpatch.tiny), its adapter is read off it, and the patches hfpatch
would accept are listed with the reasons for the rest (`hfpatch supported`, `hfpatch.supported()`).

Measuring every family takes a minute or two, so the result is cached per transformers version and hfpatch source
(a hash of the package's files): a changed hfpatch or transformers measures again.

What `supported()` measures is what hfpatch *accepts*; the family sweep (tests/test_families.py, tests/test_tiny.py:
yarn equal to native, exact unpatch, save/reload, alibi/nope decoding, norm swaps) is what shows it *works*. The sweep
that this version passed ships with it (`data/sweep.json`: the transformers versions, every family it saw and each
RoPE family's checks). A position scheme whose cached-decoding check failed there for a family is not listed for it
(the reason says what failed). A family of the installed transformers that the sweep has not seen is reported as
"not yet measured", with the reason, until `eval/check_transformers.py` has swept it.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers

from . import tiny
from .adapters import InferenceError, adapter_for
from .apply import patch, unpatch, unwrap
from .introspect import NO_LAYERNORM, summary
from .norm.kinds import NORMS
from .norm.placement import PLACEMENTS
from .position.attention.temperature import TEMPERATURES
from .position.registry import LAYER_HOSTS, LAYER_SCHEMES, SCHEMES
from .utils.files import cache_dir, source_hash, write_file

if TYPE_CHECKING:
    from transformers import PreTrainedModel

CACHE_FORMAT = 1
SWEEP_FILE = Path(__file__).parent / "data" / "sweep.json"
# The sweep's cached-decoding check, one per scheme that replaces the position signal or the attention (every scheme
# but the RoPE rescalings, which the sweep checks against transformers' own RoPE): "f_decode:<scheme>"
DECODE_CHECK = "f_decode:"
DECODE_SCHEMES = [name for name, rec in SCHEMES.items() if rec.rope is None]


def sweep_baseline() -> dict:
    """The family sweep this version passed: {"passed_on": [transformers versions], "model_types": [every causal-LM
    type those versions have], "rope_checks": {type: {check: "pass" | "n/a: why"}}}."""
    return json.loads(SWEEP_FILE.read_text())


def sweep_status(model_type: str, baseline: dict) -> str:
    """"swept", or "not yet measured: <why>" for a family the shipped sweep did not see."""
    if model_type in baseline["model_types"]:
        return "swept"
    versions = ", ".join(baseline["passed_on"])
    return (f"not yet measured: the family sweep of this hfpatch ran on transformers {versions}, which has no "
            f"{model_type}; what is listed was read off a tiny model but not checked end to end "
            "(eval/check_transformers.py sweeps it)")


def _cache_path() -> Path:
    return cache_dir() / "supported" / f"transformers-{transformers.__version__}-{source_hash()}.json"


def measure_one(model_type: str) -> dict:
    """{"built": bool, "reason" | norm, placement, position, causal, adapter, patches} for one model type."""
    try:
        with tiny.quiet(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = tiny.build_tiny(model_type)
    except tiny.TinyBuildError as e:
        return {"built": False, "reason": str(e)}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = summary(model, adapter_for(model))
            return {"built": True, "rope_config": tiny.has_rope(model.config), **tried_layers(model, result)}
    except InferenceError as e:
        return {"built": True, "rope_config": tiny.has_rope(model.config), "inferred": False, "reason": str(e)}


def tried_layers(model: PreTrainedModel, result: dict) -> dict:
    """`result` with the per-layer position schemes that a patch of the tiny model refuses moved to not_available:
    whether a family's blocks hand their attention the rotary module's cos/sin is only seen by patching (each
    scheme in its first attention layer, the rest YaRN), and undone at once."""
    patches = result["patches"]
    # under the first scheme of LAYER_HOSTS that applies (the one they are used with most, else plain RoPE)
    rest: dict[str, Any] | None = next(
        ({"position": s, **({"factor": 2.0} if SCHEMES[s].factor == "required" else {})}
         for s in LAYER_HOSTS if s in patches["position"]), None)
    if not patches["position_layers"] or rest is None:
        return result
    first = (adapter_for(model).attention_layers or (0,))[0]
    refused = {}
    for name in patches["position_layers"]:
        try:
            patch(model, **rest, layers={name: [first]})
        except ValueError as e:
            refused[f"position_layers={name}"] = str(e)
        finally:
            unpatch(model)
    if not refused:
        return result
    return {**result, "patches": {**patches, "position_layers": [n for n in patches["position_layers"]
                                                                 if f"position_layers={n}" not in refused],
                                  "not_available": {**patches["not_available"], **refused}}}


def measure(model_types: Iterable[str] | None = None, use_cache: bool = True,
            progress: Callable[[str], Any] | None = None) -> dict:
    """{model_type: measure_one(model_type)} for the named types, or every causal-LM type of the installed
    transformers, read against the shipped sweep (as_swept). ValueError for a name that is not one."""
    return as_swept(measure_raw(model_types, use_cache, progress), sweep_baseline())


def measure_raw(model_types: Iterable[str] | None = None, use_cache: bool = True,
                progress: Callable[[str], Any] | None = None) -> dict:
    """measure() before the shipped sweep is read: what hfpatch accepts, as eval/check_transformers.py records it."""
    known = tiny.causal_lm_types()
    types = list(model_types) if model_types else known
    unknown = sorted(set(types) - set(known))
    if unknown:
        raise ValueError(f"not a causal-LM model type of transformers {transformers.__version__}: "
                         f"{', '.join(unknown)} (see hfpatch supported for the {len(known)} it has)")
    path = _cache_path()
    cached: dict = {}
    if use_cache and path.is_file():
        try:
            data = json.loads(path.read_text())
            cached = data["families"] if data.get("format") == CACHE_FORMAT else {}
        except (OSError, ValueError, KeyError):
            cached = {}
    out, fresh = {}, False
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads cost more than they gain
    try:
        for t in types:
            if t not in cached:
                cached[t] = measure_one(t)
                fresh = True
            out[t] = cached[t]
            if progress is not None:
                progress(t)
    finally:
        torch.set_num_threads(threads)
    if use_cache and fresh:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"format": CACHE_FORMAT, "families": cached}, indent=1, sort_keys=True)
        write_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return out


def as_swept(results: dict, baseline: dict) -> dict:
    """{model_type: measure_one's result} read against the shipped sweep: each with its sweep status, and without
    the schemes whose cached decoding failed there."""
    return {t: {**without_failed_decoding(r, baseline["rope_checks"].get(t, {})), "sweep": sweep_status(t, baseline)}
            for t, r in results.items()}


def without_failed_decoding(result: dict, checks: dict) -> dict:
    """`result` (measure_one's) without the position schemes whose cached-decoding check failed in the shipped
    sweep: they move to not_available with what failed."""
    if "patches" not in result:
        return result
    failed = {s: checks[DECODE_CHECK + s] for s in result["patches"]["position"]
              if checks.get(DECODE_CHECK + s, "").startswith("FAIL")}
    if not failed:
        return result
    patches = result["patches"]
    why = {f"position={s}": f"position={s!r} failed the family sweep's cached-decoding check: "
           f"{v.removeprefix('FAIL: ')}" for s, v in failed.items()}
    return {**result, "patches": {**patches, "position": [s for s in patches["position"] if s not in failed],
                                  "not_available": {**patches["not_available"], **why}}}


def supported(model: PreTrainedModel | None = None, model_types: Iterable[str] | None = None,
              use_cache: bool = True) -> dict:
    """What `patch` accepts for one loaded model, or for every causal-LM model type of the installed transformers.

    Args:
        model: a loaded model; None: measure model types on a tiny random model of each instead.
        model_types: with no model, only these model types (default: all of them).
        use_cache: with no model, read the cached measurement (per transformers version and hfpatch source).

    Returns:
        For a model: its norm, placement, position signal, adapter notes and `patches` (as in `describe`). Else
        `{model_type: ...}` with the same, or why the type could not be built or read.
    """
    if model is not None:
        target = unwrap(model)
        return summary(target, adapter_for(target))
    return measure(model_types, use_cache)


def markdown(results: dict) -> str:
    """The table the README carries: one row per model type, then the counts."""
    rows = ["| model type | position schemes | norm swap | exact LN→RMS | placement | notes |",
            "|---|---|---|---|---|---|"]
    for t, r in sorted(results.items()):
        if r.get("sweep", "swept") != "swept":
            rows.append(f"| {t} | — | — | — | — | {_cell(r['sweep'])} |")
            continue
        if not r["built"] or "patches" not in r:
            rows.append(f"| {t} | — | — | — | — | {'not built tiny' if not r['built'] else 'not readable'}: "
                        f"{_cell(r['reason'])} |")
            continue
        p = r["patches"]
        notes = dict(r["adapter"]["notes"]) if isinstance(r["adapter"], dict) else {}
        exact = {True: "yes", False: "no", None: "n/a (no LayerNorm)"}[exact_layernorm_to_rmsnorm(r)]
        if exact_layernorm_to_rmsnorm(r) is None:
            notes.pop("exact", None)  # why the conversion would not be exact, for a model with nothing to convert
        rows.append(f"| {t} | {_schemes(p['position'])} | {'yes' if p['norm'] else 'no'} | {exact} | "
                    f"{'/'.join(p['placement']) or '—'} | {_cell(_notes(notes))} |")
    return "\n".join(rows) + "\n\n" + counts(results)


def counts(results: dict) -> str:
    unswept = [t for t, r in results.items() if r.get("sweep", "swept") != "swept"]
    results = {t: r for t, r in results.items() if t not in unswept}
    built = {t: r for t, r in results.items() if r["built"] and "patches" in r}
    rope = [t for t, r in results.items() if r.get("rope_config")]
    n = lambda pred: sum(1 for r in built.values() if pred(r["patches"]))
    lines = [
        f"- causal-LM model types: {len(results)}; built tiny and read: {len(built)}; not built: "
        f"{sum(not r['built'] for r in results.values())}; built but unreadable: "
        f"{sum(r['built'] and 'patches' not in r for r in results.values())}",
        f"- configs carrying RoPE: {len(rope)}; RoPE schemes apply to {n(lambda p: 'yarn' in p['position'])}",
        "- " + "; ".join(f"{name}: {n(lambda p, name=name: name in p['position'])}"  # every other scheme
                         for name, rec in SCHEMES.items() if rec.rope is None),
        "- per-layer positions (layers=): " + "; ".join(
            f"{name}: {n(lambda p, name=name: name in p.get('position_layers', ()))}" for name in LAYER_SCHEMES),
        "- attention temperature: " + "; ".join(
            f"{name}: {n(lambda p, name=name: name in p.get('attention_temperature', ()))}" for name in TEMPERATURES),
        f"- norm swaps: {n(lambda p: bool(p['norm']))}; exact LayerNorm→RMSNorm: "
        f"{sum(exact_layernorm_to_rmsnorm(r) is True for r in built.values())} (of "
        f"{sum(exact_layernorm_to_rmsnorm(r) is not None for r in built.values())} with LayerNorms); pre/post "
        f"placement: {n(lambda p: {'pre', 'post'} <= set(p['placement']))}",
        "- " + "; ".join(f"norm={name}: {n(lambda p, name=name: name in p['norm'])}" for name in NORMS),
        "- " + "; ".join(f"placement={name}: {n(lambda p, name=name: name in p['placement'])}"
                         for name in PLACEMENTS),
    ]
    if unswept:
        lines.append(f"- not yet measured by the family sweep (not counted above): {len(unswept)}: "
                     f"{', '.join(sorted(unswept))}")
    return "\n".join(lines)


def exact_layernorm_to_rmsnorm(result: dict) -> bool | None:
    """Whether LayerNorm -> RMSNorm is exact on a measured model type; None where it has no LayerNorm to convert
    (decided from its norm kind, so that results measured before describe() said null read the same)."""
    return None if result["norm"] in NO_LAYERNORM else bool(result["patches"]["exact_layernorm_to_rmsnorm"])


# what each adapter note is about, as the table's notes column names it
_NOTE_TOPICS = {"exact": "exact LN→RMS", "placement": "placement", "positions": "positions", "attention": "attention",
                "norms": "norms", "unrecognised_norms": "norms", "removal": "position removal", "blocks": "blocks"}


def _notes(notes: dict) -> str:
    """The adapter's notes, each under what it is about: "exact LN→RMS: the block norms are ...; placement: ..."."""
    return "; ".join(f"{_NOTE_TOPICS.get(k, k)}: {v}" for k, v in notes.items())


def _schemes(names: list) -> str:
    rope = {s for s, rec in SCHEMES.items() if rec.rope is not None}
    have = set(names)
    parts = (["all RoPE"] if rope <= have else sorted(have & rope)) + sorted(have - rope)
    return ", ".join(parts) or "none"


def _cell(text: str) -> str:
    text = " ".join(str(text).split()).replace("|", "/")
    return text if len(text) <= 140 else text[:137] + "..."
