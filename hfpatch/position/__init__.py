"""Position schemes: RoPE scaling (rope.py), ALiBi (alibi.py), absolute tables (absolute.py)."""

from __future__ import annotations

from .rope import COMMON_OPTIONS, ROPE_SCHEMES, RopeScheme

# Schemes that replace the position signal rather than rescale RoPE. Same fields as RopeScheme; `build` unused.
OTHER_SCHEMES: dict[str, RopeScheme] = {
    "alibi": RopeScheme(None, factor="none", options=("alibi_max_bias",)),
    "nope": RopeScheme(None, factor="none"),
    "sinusoidal": RopeScheme(None, factor="none"),
    "interpolate": RopeScheme(None, factor="required"),
}
SCHEMES: dict[str, RopeScheme] = {**ROPE_SCHEMES, **OTHER_SCHEMES}


def options_of(name: str) -> set[str]:
    info = SCHEMES[name]
    common = set(COMMON_OPTIONS) if name in ROPE_SCHEMES else set()
    return set(info.options) | common | ({"factor"} if info.factor != "none" else set())
