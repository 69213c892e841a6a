"""Taking a model's own position signal out, which nope, sinusoidal, alibi, t5, xl and learned start with: RoPE
becomes the identity, a learned table's lookup returns zeros (or the rows another lookup gives), and a probe input
checks, numerically, that no position signal is left."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...adapters import Adapter, get_path
from ...adapters.infer import mixer_paths
from ...adapters.positions import ZeroPositions, make_identity
from ...adapters.probe import position_sources
from ...edits import Edits
from ..attention.modules import attention_layers
from ..rope.rotary import rotaries_of
from . import absolute

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def remove_positions(model: PreTrainedModel, adapter: Adapter, scheme: str, edits: Edits, reloadable: bool = False,
                     lookup: type = ZeroPositions) -> None:
    """Take the model's own position signal out: RoPE becomes the identity, a learned table's lookup is replaced by
    `lookup` (zeros, or absolute.SinusoidalPositions: rows that encode position); then check, numerically, that no
    position signal is left but the one `lookup` adds.

    reloadable: the patch adds weights, so a saved model is rebuilt and loaded by transformers, whose loader
    recomputes the rotary modules' (non-persistent) frequencies from their config: they get a mixin that zeroes
    them again (absolute.NoRotation)."""
    base = model.base_model
    for rotary, rcfg in rotaries_of(model, adapter):  # RoPE becomes the identity: cos = 1, sin = 0 everywhere
        make_identity(rotary, rcfg, edits)
        if reloadable:
            edits.mix_in(rotary, absolute.NoRotation)
    if adapter.position_table:
        edits.mix_in(get_path(base, adapter.position_table), lookup, under=True)
    _check_removed(model, adapter, scheme, embedded_allowed=lookup is not ZeroPositions)


def _check_removed(model: PreTrainedModel, adapter: Adapter, scheme: str, embedded_allowed: bool) -> None:
    """After the model's own position signal was taken out, no attention block may still tell positions apart, nor
    the embeddings unless `embedded_allowed` (a table lookup that now returns sinusoidal rows): checked on a
    repeated token (adapters.probe.position_sources). Skipped on a model without weights yet (a reload builds it on
    the meta device; the check was made when the patch was saved)."""
    if any(p.device.type == "meta" for p in model.parameters()):
        return
    top = "" if model.base_model is model else model.base_model_prefix + "."
    mixers = mixer_paths(f"{top}{adapter.layers}", adapter.attention, attention_layers(model, adapter))
    embedded, sources = position_sources(model, mixers, f"{top}{adapter.layers}")
    if sources or (embedded and not embedded_allowed):
        where = sources[0] if sources else "the embeddings"
        raise ValueError(f"position={scheme!r} takes out {adapter.model_type}'s position signal, but one remains "
                         f"after removing {_signal_of(adapter)} ({where} still tells positions apart on a repeated "
                         "token): hfpatch cannot find all of it")


def _signal_of(adapter: Adapter) -> str:
    found = [*(f"the rotary module {r}" for r in adapter.rotaries),
             *([f"the position table {adapter.position_table}"] if adapter.position_table else [])]
    return ", ".join(found) or "nothing (none was found)"
