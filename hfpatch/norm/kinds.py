"""The registry of norm kinds: one record per kind, read by validation (`spec`), application (`apply`, through
norm/convert.apply_norm), `supported()` / `describe()` and the command line. Adding a norm is adding its module
class (norm/modules.py) and one record here (docs/extending.md); nothing else branches on its name.

A record says:
- `module`: the norm module class a swap builds (it keeps the replaced norm's weight, offset and eps);
- `requires`: what it needs of a model, as names of `REQUIREMENTS` (each a test on the model and its adapter, and
  the reason when it fails), so that a refusal says why and `supported()` lists exactly what `patch` accepts;
- the exactness rule: `exact(model, adapter, placement, edits)`, the function-preserving conversion into this kind
  where the math has one (made through `edits`; returns None, or why it cannot be made, having changed nothing), or
  `inexact`, why a swap into this kind never preserves the function;
- `bias`: whether the kind's form always has a bias (a zero one where the replaced norm had none; RMSNorm keeps
  whatever bias the replaced norm had);
- `prepare(model, edits)`: what the model needs before its norms are swapped, returning {attribute: value} for
  every new norm module (BatchNorm: the record of which tokens are padding);
- `check(model)`: after the swap, why the model cannot be used as it is (a warning), or None (BatchNorm: fresh
  running statistics that give non-finite logits).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..registry import Registry
from .batchnorm import attach, fresh_statistics_problem
from .convert import exact_rmsnorm, norm_sites
from .modules import BatchNorm, DyT, LayerNorm, RMSNorm

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..adapters import Adapter
    from ..edits import Edits


@dataclass(frozen=True)
class Requirement:
    test: Callable  # (model, adapter) -> bool
    why: Callable  # (model, adapter, kind) -> the reason it does not apply


def _no_norms(model: PreTrainedModel, adapter: Adapter, kind: str) -> str:
    unread = adapter.notes.get("unrecognised_norms")
    return (f"norm={kind!r}: no norm module of {adapter.model_type} computes RMSNorm or LayerNorm of its input (none "
            f"was recognised){'; ' + unread if unread else ''}")


REQUIREMENTS: dict[str, Requirement] = {
    # the model has norm modules hfpatch recognised by what they compute
    "norms": Requirement(lambda model, adapter: bool(norm_sites(model, adapter)), _no_norms),
}


@dataclass(frozen=True)
class Norm:
    module: type
    summary: str
    requires: tuple[str, ...] = ("norms",)
    exact: Callable | None = None  # (model, adapter, placement, edits) -> None (converted exactly) | why not
    inexact: str = ""  # why a swap into this kind cannot preserve the function (when `exact` is None)
    bias: bool = True
    prepare: Callable | None = None  # (model, edits) -> {attribute: value} set on every new norm module
    check: Callable | None = None  # (model) -> why the swapped model cannot be used as it is (None: it can)


def _padding(model: PreTrainedModel, edits: Edits) -> dict:
    return {"padding": attach(model, edits)}


NORMS: Registry[Norm] = Registry.of("norm kind", {
    "rmsnorm": Norm(RMSNorm, "x / rms(x), times the weight", exact=exact_rmsnorm, bias=False),
    "layernorm": Norm(LayerNorm, "(x - mean) / std, times the weight, plus the bias",
                      inexact="RMSNorm -> LayerNorm cannot preserve the function: LayerNorm removes the mean, RMSNorm "
                              "keeps it"),
    "batchnorm": Norm(BatchNorm, "each channel normalised over the batch and the sequence (its real tokens)",
                      inexact="BatchNorm is never function-preserving: it normalises each channel over the batch and "
                              "the sequence, a per-token norm over the channels",
                      prepare=_padding, check=fresh_statistics_problem),
    "dyt": Norm(DyT, "tanh(α·x), times the weight, plus the bias (Dynamic Tanh: no statistics)",
                inexact="DyT is never function-preserving: tanh(α·x) squashes each element on its own instead of "
                        "dividing the token by its statistics (hfpatch.calibrate fits each α to the replaced norm)"),
})


def unavailable(kind: str, model: PreTrainedModel, adapter: Adapter) -> str | None:
    """Why norm kind `kind` does not apply to this model (None: it applies)."""
    for r in NORMS[kind].requires:
        if not REQUIREMENTS[r].test(model, adapter):
            return REQUIREMENTS[r].why(model, adapter, kind)
    return None
