"""The model's own position signal as inference reads it: the rotary modules, a learned position table, and
whether taking them out leaves anything else that encodes position (the position patches need it not to).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...edits import Edits
from .. import probe as probes
from ..base import get_path
from ..positions import ZeroPositions, make_identity
from .reading import Info

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def mixer_paths(layers_top: str, attention: str | None, indices: list[int]) -> list[str]:
    """Top-model paths of the modules that mix positions: the attention modules, or the blocks where none was
    found."""
    return [f"{layers_top}.{i}.{attention}" if attention else f"{layers_top}.{i}" for i in indices]


def read_position_notes(model: PreTrainedModel, rotaries: tuple[str, ...], table: Any, mixers: Any, layers_top: str,
                        removable: bool) -> dict:
    """{"positions": why} when the model encodes position somewhere hfpatch did not find; {"removal": why} when
    taking out what it found leaves a position signal (checked only where `removable`: attention goes through the
    interface, which alibi / nope / sinusoidal need anyway); {} otherwise."""
    if rotaries or table:
        why = _removal_leaves(model, rotaries, table, mixers, layers_top) if removable else None
        return {"removal": why} if why else {}
    # nothing found: make sure there is nothing to find (a rotation computed inside attention, GPT-J style)
    try:
        embedded, sources = probes.position_sources(model, mixers, layers_top)
    except Exception as e:  # a test that cannot run says nothing: refuse, with the reason
        return {"positions": f"the position test could not run ({type(e).__name__}: {e})"}
    if embedded or sources:
        return {"positions": "the model encodes position (on a repeated token, " + (
            "its embeddings differ by position" if embedded else f"{sources[0]} makes positions differ") +
            ") but hfpatch found neither a rotary module (an inv_freq buffer) nor a learned position table"}
    return {}


def _removal_leaves(model: Any, rotaries: tuple[str, ...], table: Any, attention: Any, layers_top: Any) -> str | None:
    """Whether taking out the position signal hfpatch found (rotaries -> identity, the table -> zeros) leaves none
    (what alibi / nope / sinusoidal rely on): tried on the model, checked numerically, undone. None, or what
    still tells positions apart."""
    edits = Edits()
    base = model.base_model
    try:
        for path in rotaries:
            rotary = get_path(base, path)
            make_identity(rotary, rotary.config, edits)
        if table:
            edits.mix_in(get_path(base, table), ZeroPositions, under=True)
        embedded, sources = probes.position_sources(model, attention, layers_top)
    except Exception as e:  # a test that cannot run says nothing: refuse, with the reason
        return f"the test that the position signal can be taken out could not run ({type(e).__name__}: {e})"
    finally:
        edits.undo()
    if embedded or sources:
        where = sources[0] if sources else "the embeddings"
        return (f"after its rotary modules / position table are taken out, {where} still tells positions apart "
                "(on a repeated token): the model has a position signal hfpatch cannot remove")
    return None


def read_rotaries(info: Info) -> tuple[str, ...]:
    """Base-relative paths of the rotary modules: modules of the base model with an inv_freq buffer (or one per
    layer type, "{type}_inv_freq"), called by the forward, whose output changes when those buffers do (some classes
    recompute their frequencies from the config at every call: rebuilding their buffers would do nothing). Rotary
    modules the short probe did not call (DeepSeek-V4's compressor rotaries, used on longer sequences) are included
    when they are of a verified class or read the same config object as a verified one."""
    out, verified, uncalled = [], set(), []
    for name, module in info.model.named_modules():
        keys = [b for b in module._buffers if b == "inv_freq" or (b.endswith("_inv_freq")
                                                                   and not b.endswith("original_inv_freq"))]
        call = info.call(name)
        if not keys or not name.startswith(info.prefix):
            continue
        if call is None:
            uncalled.append((name, module))
            continue
        saved = {k: module._buffers[k] for k in keys}
        # positions shifted by one: at position 0 every frequency rotates by nothing
        args = [a + 1 if _is_ids(a) else a for a in call.args]
        kwargs = {k: v + 1 if _is_ids(v) else v for k, v in call.kwargs.items()}
        try:
            with torch.no_grad():
                before = _flat(module(*args, **kwargs))
                for k in keys:
                    module._buffers[k] = saved[k] * 0.5 + 0.1
                after = _flat(module(*args, **kwargs))
        except Exception:  # not callable with its recorded inputs: not a module we can rebuild
            continue
        finally:
            module._buffers.update(saved)
        if before.numel() == 0:  # called on no positions at all (a compressor on a short sequence)
            uncalled.append((name, module))
        elif not torch.equal(before, after):
            out.append(info.rel(name))
            verified |= {type(module), id(getattr(module, "config", None))}
    out += [info.rel(name) for name, m in uncalled
            if type(m) in verified or (getattr(m, "config", None) is not None and id(m.config) in verified)]
    return tuple(sorted(out, key=lambda n: (n.count("."), n)))


def _is_ids(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.dtype in (torch.int64, torch.int32)


def _flat(out: Any) -> torch.Tensor:
    parts = out if isinstance(out, (tuple, list)) else (out,)
    return torch.cat([p.detach().float().reshape(-1) for p in parts if isinstance(p, torch.Tensor)])


def read_position_table(info: Info, layers_top: str) -> tuple[str | None, int]:
    """An nn.Embedding of the base model (not the token embedding) looked up with the position ids 0..T-1 (+ an
    offset): a learned absolute position table."""
    model = info.model
    tok = model.get_input_embeddings()
    t = info.probe.ids.shape[1]
    for name, call in info.probe.calls.items():
        m = model.get_submodule(name)
        if not isinstance(m, nn.Embedding) or m is tok or not name.startswith(info.prefix) \
                or name.startswith(layers_top + "."):
            continue
        ids = call.args[0] if call.args and isinstance(call.args[0], torch.Tensor) else None
        if ids is None or ids.dtype not in (torch.int64, torch.int32) or ids.shape[-1] != t:
            continue
        k = int(ids.reshape(-1, t)[0, 0])
        if torch.equal(ids.reshape(-1, t)[0].cpu(), torch.arange(k, k + t)):
            return info.rel(name), k
    return None, 0

