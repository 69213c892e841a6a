"""The registry of position schemes: one record per scheme, read by validation (`spec`), application (`apply`),
`supported()` / `describe()`, saving (`io`), the evaluations' length limits and the recipes' sequence splitting.
Adding a scheme is its applier and one `register(name, Scheme(...))` call, here or from the scheme's own module
(outside the package too: docs/extending.md); nothing else branches on its name.

A record says:
- `apply(model, adapter, req, scheme, edits)`: how it is put into a model (every change through `edits`);
- `requires`: what it needs of a model, as names of `REQUIREMENTS` (each a test on the adapter and the reason when
  it fails), so that a refusal says why and `supported()` lists exactly what `patch` accepts;
- `factor` ("required" | "optional" | "none") and `options` {name: validator}: the keyword arguments it takes;
- `check`: validation across options (beta_fast > beta_slow, ...);
- `rope`: for RoPE rescaling, the pure builder of transformers `rope_parameters` (rope/builders.py);
- `per_forward(rotary, base, window, opts, edits)`: for RoPE rescaled again at every forward (dynamic-yarn), what
  makes the rotary module do so;
- `max_positions`: what a RoPE rescaling writes to config.max_position_embeddings: "extended" (trained window x
  factor, when a factor is given) or "window" (the trained window: transformers' dynamic NTK reads it as such);
- `limit`: the length limit of the patched model (max_position_embeddings, or a learned table's rows): "table" (a
  hard one: a longer sequence fails, so evaluations refuse lengths past it), "window" (the model only degrades
  past it, which is what the evaluations measure) or None (none at all: ALiBi, NoPE, sinusoidal, dynamic scaling);
- `native`: whether plain transformers reloads the patched model as it is (native `rope_parameters`, or a plain
  checkpoint such as an interpolated table);
- `changes_weights`: whether it changes which weights exist (reloads by loading into the patched structure);
- `split`: why it cannot train with each sequence split over processes (context parallelism, Ulysses), or None;
- `paths`: the ways its own attention function computes a call, fastest first, registered with attention/paths.py
  when the record is;
- `gguf` (position/rope/llamacpp.py `Gguf`): its GGUF forms both ways, llama.cpp's metadata written from the request
  and read back into a patch; or `gguf_refusal`: why a GGUF cannot carry it (a text, or a `Refusal` whose text names
  the settings to run instead);
- `serving` (position/rope/serving.py `Serving`): what vLLM and SGLang read of it, saved as one of transformers'
  rope_types;
- `search` (position/search_space.py `Space` or `Operators`): what `hfpatch search` varies of it, and
  `per_pair_seed`: whether its per-pair factors start the per-pair (LongRoPE) family's population.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..adapters import Adapter
from ..registry import Registry
from . import layers, spaces
from .attention import paths
from .checks import number, positive_int
from .requirements import REQUIREMENTS
from .rope import builders as rope
from .rope import llamacpp as cpp
from .rope import serving
from .rope.rotary import make_dynamic_yarn
from .rope.serving import Serving
from .schemes import alibi, dual_chunk, relative, self_extend
from .schemes.alibi import apply_alibi
from .schemes.dual_chunk import apply_dual_chunk
from .schemes.learned import apply_learned
from .schemes.relative import apply_t5, apply_xl, check_t5
from .schemes.self_extend import apply_self_extend
from .search_space import Operators, Space
from .signal import apply_interpolate, apply_nope, apply_rope, apply_sinusoidal, keep_high_frequencies

# ------------------------------------------------------------------------------------------------ option checks


# The largest context extension ratio: 65536 already takes a 4k window to 268M tokens; past it the extended window
# overflows the integers and floats the RoPE formulas compute with.
MAX_FACTOR = 65536.0


def at_most(limit: float, why: str, *, integer: bool = False) -> Callable[[str, Any], Any]:
    """A validator of positive numbers (integers) up to `limit`, `why` saying what the option is."""
    def check(name: str, value: Any) -> Any:
        if integer:
            value = positive_int(name, value)
            if value > limit:
                raise ValueError(f"{name} must be at most {int(limit)} ({why}), got {value}")
            return value
        return number(name, value, at_most=limit, why=why)
    return check


def positive(name: str, value: Any) -> Any:
    return number(name, value)


def real(name: str, value: Any) -> Any:
    return number(name, value, positive=False)


def factor(name: str, value: Any) -> Any:
    return number(name, value, above_one=True, at_most=MAX_FACTOR, why="the context extension ratio")


def _fraction(name: str, value: Any) -> Any:
    value = number(name, value)
    if value > 1.0:
        raise ValueError(f"{name} must be in (0, 1] (the fraction of rotary pairs kept), got {value:g}")
    return value


def flag(name: str, value: Any) -> Any:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def numbers_list(name: str, value: Any) -> Any:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be a list of numbers (one per rotary frequency), got {value!r}")
    return [number(f"{name}[{i}]", v) for i, v in enumerate(value)]


def names(name: str, value: Any) -> Any:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple, set)) or not value or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name} must be a non-empty list of layer type names, got {value!r}")
    return sorted(set(value))


def layer_groups(name: str, value: Any) -> Any:
    return layers.request(value, LAYER_SCHEMES)


@dataclass(frozen=True)
class Option:
    """One keyword argument a scheme takes: its check (name, value) -> the normalized value, one line of help (the
    command line and the docs read it), and its form on the command line ("number", "integer", "flag", "numbers":
    a JSON or comma-separated list, "names": one or more words)."""

    check: Callable[[str, Any], Any]
    help: str
    kind: str = "number"


# The longest trained window an option may name: 2**31 tokens is far past any model's, and position arithmetic
# with windows near 2**63 overflows torch's int64 (dynamic NTK failed at the first forward).
MAX_WINDOW = 2 ** 31

# Options every RoPE rescaling scheme takes.
ROPE_COMMON = {
    "original_max_position_embeddings": Option(at_most(MAX_WINDOW, "the trained window in tokens", integer=True),
                                               "the trained window, where the config names none or another",
                                               "integer"),
    "layer_types": Option(names, "per-layer-type RoPE (gemma3): the layer types to scale (default: the global "
                          "ones)", "names"),
    # per-layer positions (position/layers.py): other schemes in some layers, the rotary module's cos/sin changed
    # before those layers' attention sees them
    "layers": Option(layer_groups, "another scheme in some layers: {scheme: layers}, e.g. {'nope': 'every4'}",
                     "layers"),
}
# The schemes a RoPE model can give some of its layers (`layers=`): they change what the layers' attention receives
# from the one rotary module, so they combine with any RoPE rescaling for the other layers.
LAYER_SCHEMES: Registry[layers.LayerScheme] = Registry.of("per-layer position scheme", {
    "nope": layers.LayerScheme("no position signal in these layers: their attention gets cos 1, sin 0 on every "
                               "channel (Llama 4's iRoPE NoPE layers, Cohere's 3:1 interleaving)"),
    "p-rope": layers.LayerScheme("p-RoPE in these layers: only the highest-frequency fraction `keep` of the rotary "
                                 "pairs rotates (default 0.75), the others get cos 1, sin 0",
                                 options={"keep": _fraction}, dropped=layers.low_frequency_pairs),
})
MIN_ROTATIONS = 1e-6  # fewer rotations than this over the trained window: no pair is that slow (YaRN's ramp ends)


def _rotations(name: str, value: Any) -> float:
    """YaRN's β: a number of rotations over the trained window, in [MIN_ROTATIONS, 1e6]. (A β near 0 made the
    correction range window / (2π β) overflow to infinity: an OverflowError when patching or at the first forward.)"""
    value = number(name, value, at_most=1e6, why="a number of rotations over the trained window")
    if value < MIN_ROTATIONS:
        raise ValueError(f"{name} must be at least {MIN_ROTATIONS:g} (a number of rotations over the trained "
                         f"window), got {value:g}")
    return value


# YaRN's options are the ones its builder passes on (rope.YARN_OPTIONS)
YARN_OPTIONS = {
    "attention_factor": Option(at_most(100.0, "it multiplies every attention logit by its square"),
                               "the factor cos and sin are multiplied by (default 0.1 ln(factor) + 1)"),
    "beta_fast": Option(_rotations, "YaRN's β: pairs rotating more often than this over the window keep their "
                        "frequency (default 32)"),
    "beta_slow": Option(_rotations, "YaRN's α: pairs rotating less often than this are interpolated fully "
                        "(default 1)"),
    "mscale": Option(real, "DeepSeek's mscale (the attention factor's numerator)"),
    "mscale_all_dim": Option(real, "DeepSeek's mscale_all_dim (the attention factor's denominator)"),
    "truncate": Option(flag, "round the correction range to whole channels (default true)", "flag"),
}
assert set(YARN_OPTIONS) == set(rope.YARN_OPTIONS), "every option YaRN's builder passes on has its check here"


def _betas(req: dict) -> None:
    if "beta_fast" in req and "beta_slow" in req and req["beta_fast"] <= req["beta_slow"]:
        raise ValueError(f"beta_fast must be greater than beta_slow, got {req['beta_fast']} <= {req['beta_slow']}")


def _llama3(req: dict) -> None:
    lo, hi = req.get("low_freq_factor", 1.0), req.get("high_freq_factor", 4.0)
    if hi <= lo:
        raise ValueError(f"high_freq_factor must be greater than low_freq_factor, got {hi} <= {lo}")


def _longrope(req: dict) -> None:
    missing = [k for k in ("short_factor", "long_factor") if k not in req]
    if missing:
        raise ValueError(f"position='longrope' needs {' and '.join(missing)}: lists of per-frequency scale factors "
                         "(rotary_dim / 2 numbers each)")


# ------------------------------------------------------------------------------------------------------ schemes


@dataclass(frozen=True)
class Scheme:
    apply: Callable
    requires: tuple[str, ...]
    summary: str
    factor: str = "none"  # "required" | "optional" | "none"
    options: dict[str, Option] = field(default_factory=dict)  # keyword -> its check and help
    check: Callable | None = None  # validation across options, on the normalized request
    rope: Callable | None = None  # RoPE rescaling: builder -> rope_parameters
    per_forward: Callable | None = None  # RoPE rescaled at every forward: (rotary, base, window, opts, edits)
    max_positions: str = "extended"  # "extended" | "window"
    limit: str | None = "window"  # "table" | "window" | None
    native: bool = True
    changes_weights: bool = False
    split: str | None = None  # why sequences cannot be split over processes while it trains (None: they can)
    # RoPE: a change of the rebuilt rotary's frequencies that rope_parameters cannot express (p-RoPE on a partial
    # rotation): (rotary, {layer type: pairs rotated before}, opts, edits)
    frequencies: Callable | None = None
    native_for: Callable | None = None  # (a layer type's base rope_parameters) -> whether native there (p-RoPE)
    paths: tuple = ()  # its own attention function's ways to compute a call, fastest first (attention/paths.py)
    # GGUF: its forms both ways (position/rope/llamacpp.py), or why a GGUF cannot carry it (a text, or a Refusal
    # naming what to run instead); neither: not RoPE
    gguf: cpp.Gguf | None = None
    gguf_refusal: str | cpp.Refusal | None = None
    serving: Serving | None = None  # what serving engines read of it, saved natively (rope/serving.py)
    search: Space | Operators | None = None  # what hfpatch search varies of it (search_space.py)
    per_pair_seed: bool = False  # its per-pair factors start the per-pair family's population


# Why a scheme cannot train with its sequences split over processes (train/parallel.py): each process then holds a
# shard of every sequence, its positions passed in as position ids, and sees only its own shard's keys.
_DYNAMIC = "each shard would scale RoPE by the largest position it holds, so the shards would disagree"


def _own_attention(what: str) -> str:
    return (f"its attention function {what} from the local shard's key slots, not from the positions of the whole "
            "sequence")


def rope_scaling(builder: Callable, summary: str, factor: str = "required", options: dict[str, Option] | None = None,
                 requires: tuple[str, ...] = ("rope", "window"), **fields: Any) -> Scheme:
    """The record of a RoPE rescaling: `builder` (base rope_parameters, trained window, options, rotated channels) ->
    the new rope_parameters, applied by `apply_rope`, with the options every RoPE rescaling takes (ROPE_COMMON) and
    the record's other `fields` (check, gguf, serving, search, ...)."""
    return Scheme(apply_rope, requires, summary, factor, {**ROPE_COMMON, **(options or {})}, rope=builder, **fields)


# Why a GGUF cannot carry a RoPE whose frequencies follow the sequence length
_FIXED_AT_CONTEXT = "llama.cpp's frequencies are fixed when the context is created"


_REPLACE = ("known_positions",)

class Schemes(Registry[Scheme]):
    """The registry of position schemes: registering a record checks that its parts fit together and registers its
    attention paths (attention/paths.py), so that a scheme registered from outside the package is whole too."""

    def register(self, name: str, record: Scheme) -> Scheme:
        if name not in self:  # else the registry's own error: registered twice
            _check_record(name, record, self)
            if record.paths:
                paths.register(name, record.paths)
        return super().register(name, record)


def _check_record(name: str, record: Scheme, registered: Registry[Scheme]) -> None:
    """ValueError for a record whose fields do not fit together."""
    rope_only = [f for f in ("gguf", "serving", "per_pair_seed") if getattr(record, f)]
    if rope_only and record.rope is None:
        raise ValueError(f"position scheme {name!r}: {'=, '.join(rope_only)}= describe a RoPE rescaling, and its "
                         "record has no rope= builder (position.registry.rope_scaling makes one)")
    if record.per_pair_seed and record.factor == "none":
        raise ValueError(f"position scheme {name!r}: per_pair_seed=True starts the per-pair family at the search's "
                         "extension ratio, which the scheme takes as factor=; it takes none")
    for other, rec in registered.items():
        if record.serving is not None and rec.serving is not None and rec.serving != record.serving \
                and rec.serving.rope_type == record.serving.rope_type:
            raise ValueError(f"position scheme {name!r} saves as rope_type {record.serving.rope_type!r}, which "
                             f"{other!r} saves as with other engine readings: give it {other!r}'s serving= form")
    if isinstance(record.search, Space):
        takes = set(record.options) | ({"factor"} if record.factor != "none" else set())
        unknown = sorted(set(record.search.params) - takes)
        if unknown:
            raise ValueError(f"position scheme {name!r}: its search space varies {', '.join(unknown)}, which it does "
                             f"not take (it takes {', '.join(sorted(takes)) or 'no options'})")


SCHEMES = Schemes("position scheme")
register = SCHEMES.register

register("rope", rope_scaling(
    rope.plain, "plain RoPE at the original theta (undoes a checkpoint's scaling)", factor="none",
    max_positions="window", requires=("rope",), gguf=cpp.PLAIN, serving=serving.DEFAULT))
register("linear", rope_scaling(rope.linear, "position interpolation (Chen et al. 2023): positions / factor",
                                gguf=cpp.LINEAR, serving=serving.LINEAR, per_pair_seed=True))
register("ntk", rope_scaling(rope.ntk, "NTK-aware base change: theta * factor^(d/(d-2))", gguf=cpp.NTK,
                             serving=serving.DEFAULT, per_pair_seed=True))
register("dynamic", rope_scaling(
    rope.dynamic, "dynamic NTK: the base grows with the sequence past the window", factor="optional",
    max_positions="window", limit=None, split=_DYNAMIC, serving=serving.DYNAMIC,
    gguf_refusal=(f"dynamic NTK changes the RoPE base with the sequence length, and {_FIXED_AT_CONTEXT}; export ntk "
                  "(the base for one length) or yarn instead")))
register("yarn", rope_scaling(
    rope.yarn, "YaRN (Peng et al. 2023): NTK-by-parts + attention scaling", options=YARN_OPTIONS, check=_betas,
    gguf=cpp.YARN, serving=serving.YARN, search=spaces.YARN, per_pair_seed=True))
register("dynamic-yarn", rope_scaling(
    rope.dynamic_yarn, "YaRN with s = max(1, L / window), recomputed per forward", factor="optional", limit=None,
    native=False, check=_betas, per_forward=make_dynamic_yarn, split=_DYNAMIC,
    options={k: YARN_OPTIONS[k] for k in ("attention_factor", "beta_fast", "beta_slow", "truncate")},
    gguf_refusal=(f"dynamic YaRN changes the scale with the sequence length, and {_FIXED_AT_CONTEXT}; export yarn "
                  "with the factor you serve at")))
register("llama3", rope_scaling(
    rope.llama3, "Llama 3.1's frequency-dependent interpolation", check=_llama3, gguf=cpp.LLAMA3,
    serving=serving.LLAMA3, per_pair_seed=True,
    options={"low_freq_factor": Option(positive, "wavelengths longer than window / this are interpolated fully "
                                                 "(default 1)"),
             "high_freq_factor": Option(positive, "wavelengths shorter than window / this keep their frequency "
                                                  "(default 4)")}))
register("longrope", rope_scaling(
    rope.longrope, "LongRoPE: per-frequency factors (short/long)", check=_longrope, gguf=cpp.LONGROPE,
    serving=serving.LONGROPE, search=spaces.PER_PAIR,
    options={"short_factor": Option(numbers_list, "one rescale factor per rotary pair, within the trained window",
                                    "numbers"),
             "long_factor": Option(numbers_list, "one rescale factor per rotary pair, past the trained window",
                                   "numbers"),
             "attention_factor": Option(at_most(100.0, "it multiplies every attention logit by its square"),
                                        "the factor cos and sin are multiplied by (default "
                                        "sqrt(1 + ln(factor) / ln(window)))")}))
register("p-rope", rope_scaling(
    rope.p_rope, "p-RoPE (Barbero et al. 2025): only the highest-frequency fraction `keep` of the rotary pairs "
    "rotates (default 0.75), the rest carry no position", factor="none", max_positions="window", requires=("rope",),
    options={"keep": Option(_fraction, "the fraction of rotary pairs that keep rotating, highest frequencies first "
                                       "(default 0.75)")},
    frequencies=keep_high_frequencies, native_for=rope.p_rope_is_native))
register("alibi", Scheme(
    apply_alibi, (*_REPLACE, "attention_interface"),
    "ALiBi (Press et al. 2022): no position embedding, a per-head linear distance bias",
    options={"alibi_max_bias": Option(positive, "the largest slope exponent: slopes 2^(-max_bias * h / H) "
                                                "(default 8)")},
    limit=None, native=False, paths=alibi.PATHS,
    split="its attention function takes key positions from the local shard's indices and one slope per head of the "
          "whole model",
    gguf_refusal=("llama.cpp applies ALiBi only inside the graphs of the architectures built with it (bloom, mpt, "
                  "...), never from metadata, and a RoPE architecture keeps its rotation")))
register("nope", Scheme(apply_nope, _REPLACE, "no position signal at all (causal attention only)", limit=None,
                        native=False))
register("sinusoidal", Scheme(
    apply_sinusoidal, _REPLACE, "the fixed sinusoidal table added to the input, times pe_scale (default 1: the "
    "paper's ±1 amplitude)",
    options={"pe_scale": Option(at_most(1e3, "the amplitude of the table added to the embeddings"),
                                "the amplitude of the table added to the embeddings (default 1)")},
    limit=None, native=False))
register("interpolate", Scheme(apply_interpolate, ("table",), "a learned table stretched by linear interpolation",
                               factor="required", limit="table", changes_weights=True))
# Position encodings with new parameters, for from-scratch comparisons (schemes/relative.py, learned.py): they
# reload by loading the saved weights into the patched structure; plain transformers cannot express them.
register("t5", Scheme(
    apply_t5, (*_REPLACE, "attention_interface"),
    "T5's relative bias (Raffel et al. 2020): a learned scalar per (distance bucket, head), shared by the layers, "
    "zero at start",
    options={"num_buckets": Option(at_most(4096, "T5 uses 32", integer=True), "distance buckets (T5: 32)",
                                   "integer"),
             "max_distance": Option(at_most(2 ** 20, "T5 uses 128; distances past it share the last bucket",
                                            integer=True),
                                    "distances past it share the last bucket (T5: 128)", "integer")},
    check=check_t5, limit=None, native=False, changes_weights=True, paths=relative.T5_PATHS,
    split=_own_attention("buckets query-key distances")))
register("xl", Scheme(
    apply_xl, (*_REPLACE, "attention_interface"),
    "Transformer-XL's relative encoding (Dai et al. 2019): content and position terms, sinusoidal relative "
    "embeddings projected per layer, global biases u and v; zero at start",
    limit=None, native=False, changes_weights=True, paths=relative.XL_PATHS,
    split=_own_attention("computes query-key distances")))
register("learned", Scheme(
    apply_learned, (*_REPLACE, "no_table"),
    "a trainable absolute position table added to the input (RoPE removed), initialised small; the length limit is "
    "its size",
    options={"table_size": Option(positive_int, "rows of the new table: the patched model's length limit",
                                  "integer"),
             "init_std": Option(at_most(10.0, "the standard deviation of the new table's entries"),
                                "the standard deviation of the new table's entries")},
    limit="table", native=False, changes_weights=True))
# Self-Extend (schemes/self_extend.py): grouped positions for far keys, exact ones for neighbours; no training
register("self-extend", Scheme(
    apply_self_extend, ("rope", "trained_window", "attention_interface", "causal"),
    "Self-Extend (Jin et al. 2024): exact RoPE positions within W tokens, positions grouped by G beyond (defaults "
    "G = 4, W = 1/8 of the trained window); no training",
    options={"group_size": Option(at_most(MAX_FACTOR, "it extends the window about G times, like factor",
                                          integer=True), "G: far positions are grouped by G (default 4)", "integer"),
             "window": Option(positive_int, "W: the neighbour window kept at exact positions (default 1/8 of the "
                                            "trained window)", "integer")},
    native=False, paths=self_extend.PATHS, split=_own_attention("tells neighbour keys from grouped ones"),
    gguf_refusal=cpp.Refusal("Self-Extend is a run-time setting of llama.cpp (--grp-attn-n/--grp-attn-w)",
                             self_extend.llamacpp_refusal),
    search=spaces.SELF_EXTEND))
# Dual Chunk Attention (schemes/dual_chunk.py): positions inside chunks, the query moved for earlier chunks
register("dual-chunk", Scheme(
    apply_dual_chunk, ("rope", "trained_window", "attention_interface", "causal"),
    "Dual Chunk Attention (An et al. 2024): keys at their position inside chunks of chunk_size - local_window tokens, "
    "queries at intra-, successive- and inter-chunk positions below chunk_size (defaults 3/4 and 1/16 of the "
    "trained window); no training",
    options={"chunk_size": Option(positive_int, "the chunk size (default 3/4 of the trained window)", "integer"),
             "local_window": Option(positive_int, "the neighbour window of successive chunks (default 1/16 of the "
                                                  "trained window)", "integer")},
    native=False, limit=None, paths=dual_chunk.PATHS, split=_own_attention("tells chunks apart"),
    search=spaces.DUAL_CHUNK))

# The schemes supported() tries per-layer positions under, the first that applies: the one they are used with most
# (Llama 4 pairs NoPE layers with scaled RoPE), else plain RoPE.
LAYER_HOSTS = ("yarn", "rope")


def options_of(name: str) -> set[str]:
    s = SCHEMES[name]
    return set(s.options) | ({"factor"} if s.factor != "none" else set())


def all_options() -> set[str]:
    return set().union(*(options_of(s) for s in SCHEMES))


def request(scheme: Any, options: dict) -> dict:
    """Validate a position request: {"scheme": ..., **options} or ValueError/TypeError saying what is accepted."""
    if not isinstance(scheme, str):
        raise TypeError(f"position must be a string, one of {', '.join(SCHEMES)}; got {scheme!r}")
    name = scheme.strip().lower().replace("_", "-")
    if name not in SCHEMES:
        hint = ""
        if ":" in name or "+" in name or "=" in name:
            hint = " (a spec string such as 'yarn:4' is for the command line; in Python pass position='yarn', " \
                   "factor=4, or hfpatch.patch(model, **hfpatch.spec.parse('yarn:4')))"
        raise ValueError(f"unknown position scheme {scheme!r}; valid: {', '.join(SCHEMES)}{hint}")
    s = SCHEMES[name]
    options = {k: v for k, v in options.items() if v is not None}
    allowed = options_of(name)
    unknown = sorted(set(options) - allowed)
    if "layers" in unknown:
        raise ValueError(f"position={name!r} does not take layers: per-layer positions change the cos/sin a RoPE "
                         "model's rotary module hands some layers, so they go with a RoPE rescaling for the other "
                         f"layers ({', '.join(k for k, rec in SCHEMES.items() if rec.rope is not None)})")
    if unknown:
        raise ValueError(
            f"position={name!r} does not take {', '.join(unknown)}; "
            f"it accepts: {', '.join(sorted(allowed)) or 'no options'}"
        )
    if s.factor == "required" and options.get("factor") is None:
        raise ValueError(f"position={name!r} needs factor= (a finite number > 1, the context extension ratio)")
    out = {"scheme": name}
    for key in sorted(options):
        out[key] = factor(key, options[key]) if key == "factor" else s.options[key].check(key, options[key])
    if s.check:
        s.check(out)
    if out["scheme"] in out.get("layers", {}):
        raise ValueError(f"layers={{{out['scheme']!r}: ...}} gives some layers the scheme every other layer has "
                         f"already (position={out['scheme']!r}); name another scheme for the rest, e.g. "
                         f"position='rope', layers={{{out['scheme']!r}: ...}}")
    return out


def unavailable(name: str, adapter: Adapter, req: dict | None = None) -> str | None:
    """Why scheme `name` (with the options of `req`, if given) does not apply to a model with this adapter (None:
    it applies)."""
    for r in SCHEMES[name].requires:
        if not REQUIREMENTS[r].test(adapter, req or {}):
            return REQUIREMENTS[r].why(adapter, name)
    return None


def from_rope_type(rope_type: str) -> str:
    """The scheme a native rope_type reads as (describe() of an unpatched model)."""
    named = {"default": "rope"}
    return named.get(rope_type, rope_type)
