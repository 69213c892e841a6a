"""What a position scheme needs of a model (`REQUIREMENTS`): each a test on the model's adapter and the request, and
the reason when it fails. A scheme record names its needs (`requires`, registry.py), so that a refusal says why and
`supported()` lists exactly what `patch` accepts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..adapters import Adapter


@dataclass(frozen=True)
class Requirement:
    test: Callable  # (adapter, request) -> bool; the request is {} when asked what applies in general
    why: Callable  # (adapter, scheme name) -> the reason it does not apply


REQUIREMENTS: dict[str, Requirement] = {
    "rope": Requirement(
        lambda a, r: a.has_rope,
        lambda a, s: (f"position={s!r} is a RoPE scheme, but {a.model_type} has {_signal(a)} and no RoPE; RoPE "
                      "schemes apply to models with a rotary module (an inv_freq buffer)")),
    "window": Requirement(
        lambda a, r: a.window is not None or bool(r.get("original_max_position_embeddings")),
        lambda a, s: (f"position={s!r} needs the trained window, and {a.model_type}'s config names none (no "
                      "max_position_embeddings): pass original_max_position_embeddings=")),
    # schemes whose defaults and length limit are fractions and multiples of the trained window, with no option
    # that stands in for it
    "trained_window": Requirement(
        lambda a, r: a.window is not None,
        lambda a, s: (f"position={s!r} takes its defaults and the patched model's length limit from the trained "
                      f"window, and {a.model_type}'s config names none (no max_position_embeddings: its attention "
                      "is local only)")),
    "table": Requirement(
        lambda a, r: a.position_table is not None,
        lambda a, s: (f"position={s!r} stretches a learned absolute position table; {a.model_type} has "
                      f"{_signal(a)} (for RoPE use linear, ntk, yarn, ...)")),
    # the model's own position signal is known (a rotary module, a learned table, or none at all), so it can be
    # taken out and replaced
    "known_positions": Requirement(
        lambda a, r: a.layers is not None and a.position_signal != "unknown" and "removal" not in a.notes,
        lambda a, s: (f"position={s!r} replaces the model's position signal, but {a.model_type}'s cannot be "
                      "taken out: "
                      + (a.notes.get("positions") or a.notes.get("removal") or a.notes.get("blocks", "")))),
    "attention_interface": Requirement(
        lambda a, r: a.attention_interface,
        lambda a, s: (f"position={s!r} runs its own attention function, but {a.model_type}'s attention does not "
                      f"go through transformers' attention interface ({a.notes.get('attention', '')})")),
    "causal": Requirement(
        lambda a, r: a.causal,
        lambda a, s: f"position={s!r} is defined for causal (decoder) attention; {a.model_type} attends both ways"),
    # a new absolute table goes where there is none (a model with a table has interpolate for it)
    "no_table": Requirement(
        lambda a, r: a.position_table is None,
        lambda a, s: (f"position={s!r} adds a learned absolute position table to a model without one, but "
                      f"{a.model_type} already has one ({a.position_table}; position='interpolate' stretches it)")),
}


def _signal(a: Adapter) -> str:
    return {"rope": "RoPE positions", "learned": "learned absolute position embeddings", "none": "no position "
            "embeddings", "unknown": "a position encoding hfpatch cannot find"}[a.position_signal]
