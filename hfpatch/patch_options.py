"""What `hfpatch patch` offers on its command line, as plain data: the position schemes (and which take a factor),
every scheme option with its form and help, the norm kinds, the placements and their options, the attention
temperatures. The registries (hfpatch.position, hfpatch.norm) import torch; this module imports nothing, so
`hfpatch patch --help` answers at once.

The registries are the truth: tests/test_cli_help.py checks that `from_registries()` equals `DECLARED`, so the two
cannot drift apart. After a registry changes, `python -m hfpatch.patch_options` prints the declaration the registries
give, to paste below. A process that has imported the registries (and may have registered a scheme of its own) gets
them from the registries themselves (`offered`). The registries are imported inside the functions that read them
only: this module is one of the command's deferred entry points (tests/test_layering.py).
"""

from __future__ import annotations

import pprint
import sys
from typing import Any

# position scheme -> whether it takes a factor ("required" | "optional" | "none"), in registry order
SCHEMES: dict[str, str] = {
    "rope": "none", "linear": "required", "ntk": "required", "dynamic": "optional", "yarn": "required",
    "dynamic-yarn": "optional", "llama3": "required", "longrope": "required", "p-rope": "none", "alibi": "none",
    "nope": "none", "sinusoidal": "none", "interpolate": "required", "t5": "none", "xl": "none", "learned": "none",
    "self-extend": "none", "dual-chunk": "none",
}

# scheme option -> (its form on the command line, its help, the schemes that take it), in registry order
SCHEME_OPTIONS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "original_max_position_embeddings": (
        "integer", "the trained window, where the config names none or another",
        ("rope", "linear", "ntk", "dynamic", "yarn", "dynamic-yarn", "llama3", "longrope", "p-rope")),
    "layer_types": (
        "names", "per-layer-type RoPE (gemma3): the layer types to scale (default: the global ones)",
        ("rope", "linear", "ntk", "dynamic", "yarn", "dynamic-yarn", "llama3", "longrope", "p-rope")),
    "layers": (
        "layers", "another scheme in some layers: {scheme: layers}, e.g. {'nope': 'every4'}",
        ("rope", "linear", "ntk", "dynamic", "yarn", "dynamic-yarn", "llama3", "longrope", "p-rope")),
    "attention_factor": (
        "number", "the factor cos and sin are multiplied by (default 0.1 ln(factor) + 1)",
        ("yarn", "dynamic-yarn", "longrope")),
    "beta_fast": (
        "number", "YaRN's β: pairs rotating more often than this over the window keep their frequency (default 32)",
        ("yarn", "dynamic-yarn")),
    "beta_slow": (
        "number", "YaRN's α: pairs rotating less often than this are interpolated fully (default 1)",
        ("yarn", "dynamic-yarn")),
    "mscale": ("number", "DeepSeek's mscale (the attention factor's numerator)", ("yarn",)),
    "mscale_all_dim": ("number", "DeepSeek's mscale_all_dim (the attention factor's denominator)", ("yarn",)),
    "truncate": ("flag", "round the correction range to whole channels (default true)", ("yarn", "dynamic-yarn")),
    "low_freq_factor": (
        "number", "wavelengths longer than window / this are interpolated fully (default 1)", ("llama3",)),
    "high_freq_factor": (
        "number", "wavelengths shorter than window / this keep their frequency (default 4)", ("llama3",)),
    "short_factor": ("numbers", "one rescale factor per rotary pair, within the trained window", ("longrope",)),
    "long_factor": ("numbers", "one rescale factor per rotary pair, past the trained window", ("longrope",)),
    "keep": (
        "number", "the fraction of rotary pairs that keep rotating, highest frequencies first (default 0.75)",
        ("p-rope",)),
    "alibi_max_bias": (
        "number", "the largest slope exponent: slopes 2^(-max_bias * h / H) (default 8)", ("alibi",)),
    "pe_scale": ("number", "the amplitude of the table added to the embeddings (default 1)", ("sinusoidal",)),
    "num_buckets": ("integer", "distance buckets (T5: 32)", ("t5",)),
    "max_distance": ("integer", "distances past it share the last bucket (T5: 128)", ("t5",)),
    "table_size": ("integer", "rows of the new table: the patched model's length limit", ("learned",)),
    "init_std": ("number", "the standard deviation of the new table's entries", ("learned",)),
    "group_size": ("integer", "G: far positions are grouped by G (default 4)", ("self-extend",)),
    "window": (
        "integer", "W: the neighbour window kept at exact positions (default 1/8 of the trained window)",
        ("self-extend",)),
    "chunk_size": ("integer", "the chunk size (default 3/4 of the trained window)", ("dual-chunk",)),
    "local_window": (
        "integer", "the neighbour window of successive chunks (default 1/16 of the trained window)", ("dual-chunk",)),
}

# the norm kinds (norm=...), in registry order
NORMS: tuple[str, ...] = ("rmsnorm", "layernorm", "batchnorm", "dyt")

# placement -> the options it takes, in registry order
PLACEMENTS: dict[str, tuple[str, ...]] = {"pre": (), "post": (), "peri": (), "mix": ("post_fraction",)}

# the attention temperatures (attention_temperature=KIND), in registry order
TEMPERATURES: tuple[str, ...] = ("logn", "llama4")

DECLARED: dict[str, Any] = {"SCHEMES": SCHEMES, "SCHEME_OPTIONS": SCHEME_OPTIONS, "NORMS": NORMS,
                            "PLACEMENTS": PLACEMENTS, "TEMPERATURES": TEMPERATURES}


def scheme_options() -> dict[str, tuple]:
    """Every position option of the registry: name -> (its Option, the schemes that take it), in registry order
    (imports torch)."""
    from .position import SCHEMES as schemes

    out: dict[str, tuple] = {}
    for scheme_name, scheme in schemes.items():
        for name, option in scheme.options.items():
            first, owners = out.get(name, (option, []))
            if first.kind != option.kind:  # one flag, one form: the registry must agree with itself
                raise TypeError(f"option {name}: {owners[0]} takes a {first.kind}, {scheme_name} a {option.kind}")
            out[name] = (first, [*owners, scheme_name])
    return out


def from_registries() -> dict[str, Any]:
    """DECLARED as the registries give it (imports torch): what the declaration above must equal."""
    from .norm.kinds import NORMS as norms
    from .norm.placement import PLACEMENTS as placements
    from .position import SCHEMES as schemes
    from .position.attention.temperature import TEMPERATURES as temperatures

    return {"SCHEMES": {name: rec.factor for name, rec in schemes.items()},
            "SCHEME_OPTIONS": {name: (option.kind, option.help, tuple(owners))
                               for name, (option, owners) in scheme_options().items()},
            "NORMS": tuple(norms),
            "PLACEMENTS": {name: tuple(rec.options) for name, rec in placements.items()},
            "TEMPERATURES": tuple(temperatures)}


def offered() -> dict[str, Any]:
    """What the command line offers: the registries' own records once they are imported (a scheme registered at
    run time included), else DECLARED, which equals them without importing torch."""
    return from_registries() if "hfpatch.position.registry" in sys.modules else DECLARED


if __name__ == "__main__":
    for key, value in from_registries().items():
        print(f"{key} = {pprint.pformat(value, width=120, sort_dicts=False)}\n")
