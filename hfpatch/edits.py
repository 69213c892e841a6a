"""The one layer of hfpatch that changes live objects.

Every change a patch makes to a model (an attribute, a buffer, a config field, an instance's class) goes through
an `Edits` log that remembers what was there before. That gives us, for free:
- all-or-nothing patching: if anything fails half-way, `undo()` puts back every change already made;
- exact `unpatch`: the original tensors and objects are restored themselves, not recomputed (diff 0.0).

`undo()` and `redo()` move one entry at a time to the other list before making its change, so an exception half-way
(an interrupt, a failing setattr) leaves every change in exactly one of the two lists: `redo()` then puts back all
that `undo()` had reverted, or was about to. `deferred_interrupts()` holds Ctrl-C back while a patch is made or
undone, so that it lands before or after, never inside.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn


class _Marker:
    """A log marker that stays itself when the model is copied (copy.deepcopy) or pickled: markers are compared
    by identity."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name

    def __copy__(self) -> _Marker:
        return self

    def __deepcopy__(self, memo: dict) -> _Marker:
        return self

    def __reduce__(self) -> str:
        return self.name  # pickled by reference to this module's global


MISSING = _Marker("MISSING")  # a value that was not there: what touched() reports for an added attribute
_KEYS = _Marker("_KEYS")  # log marker: the set of attribute names an object had


class Edits:
    """An ordered log of reversible changes."""

    def __init__(self) -> None:
        # (target, attribute, (previous value or MISSING, its slot)): see _held
        # (the attribute is a name, or the _KEYS marker whose "previous value" is the set of names)
        self._log: list[tuple[object, Any, Any]] = []
        self._undone: list[tuple[object, str, object, object]] = []  # what undo() removed, for redo()

    def __len__(self) -> int:
        return len(self._log)

    def set(self, obj: Any, name: str, value: Any) -> None:
        """setattr(obj, name, value), remembering the old value (or its absence).

        On an nn.Module, assigning a tensor to a registered buffer's name replaces the buffer and keeps its
        persistence, so buffers need no special case.
        """
        self._log.append((obj, name, _held(obj, name)))
        setattr(obj, name, value)

    def delete(self, obj: Any, name: str) -> None:
        """delattr(obj, name) if it exists, remembering the value."""
        old = _held(obj, name)
        if old[0] is MISSING:
            return
        self._log.append((obj, name, old))
        delattr(obj, name)

    def swap_class(self, obj: Any, cls: type) -> None:
        """Give one instance a new class (a subclass of its own), so that class-level machinery such as
        gradient checkpointing keeps wrapping the new forward (replacing `obj.forward` would bypass it)."""
        if not issubclass(cls, type(obj)):
            raise TypeError(f"{cls.__name__} must subclass {type(obj).__name__}")
        self._log.append((obj, "__class__", type(obj)))
        obj.__class__ = cls

    def mix_in(self, obj: Any, mixin: type, under: bool = False) -> None:
        """swap_class to a subclass of obj's class with `mixin`'s methods first (see `with_mixin` for `under`)."""
        self.swap_class(obj, with_mixin(type(obj), mixin, under))

    def unmix(self, obj: Any, mixin: type) -> None:
        """Give `obj` back the class that `with_mixin` made its class from with `mixin` (a mix_in made outside this
        log, e.g. by the stage a reloaded model was built with); undo gives it the mixed class again."""
        self._log.append((obj, "__class__", type(obj)))
        obj.__class__ = without_mixin(type(obj), mixin)

    def track_new_attributes(self, obj: Any) -> None:
        """On undo, also drop attributes and buffers that appear on `obj` after this point, e.g. the caches
        transformers' dynamic RoPE update adds while the patched model runs."""
        self._log.append((obj, _KEYS, _keys(obj)))

    def absorb(self, other: Edits) -> None:
        """Take over `other`'s changes (newest last), as if they had been made through this log; `other` is left
        empty. Lets a tentative change be made in a log of its own, checked, and then kept or undone."""
        self._log.extend(other._log)
        other._log = []

    def touched(self, obj: Any) -> dict[str, object]:
        """{attribute: original value} for every attribute of `obj` this log changed (first value wins)."""
        out: dict[str, object] = {}
        for target, attr, old in self._log:
            if target is obj and attr is not _KEYS and attr not in out:
                out[attr] = old if attr == "__class__" else old[0]
        return out

    def undo(self) -> None:
        """Revert every change, newest first. The log is empty afterwards; `redo()` can put the changes back. An
        interrupt (KeyboardInterrupt) raised while it runs is held until every change is reverted."""
        self._undone = []
        with _finishing() as finish:
            while self._log:
                obj, name, old = self._log[-1]
                now = finish(_now, obj, name, old)
                # moved first, then reverted: a failure while reverting leaves the entry where redo() finds it
                self._undone.append((obj, name, old, now))
                self._log.pop()
                finish(_revert, obj, name, old, now)

    def redo(self) -> None:
        """Put back, oldest first, the very objects the last `undo()` removed (not recomputed ones: weights trained
        after the patch stay trained). Used to restore a patch when the one replacing it fails half-way. Like undo(),
        it finishes before an interrupt raised while it runs goes on."""
        with _finishing() as finish:
            while self._undone:
                obj, name, old, now = self._undone[-1]
                self._log.append((obj, name, old))  # moved first, as in undo()
                self._undone.pop()
                finish(_reapply, obj, name, now)


def _now(obj: Any, name: Any, old: Any) -> Any:
    """What undo() replaces: the class, the attributes added since the log began tracking, or the value."""
    if name == "__class__":
        return type(obj)
    if name is _KEYS:
        return {extra: _held(obj, extra) for extra in _keys(obj) - old}
    return _held(obj, name)


def _revert(obj: Any, name: Any, old: Any, now: Any) -> None:
    if name == "__class__":
        obj.__class__ = old
    elif name is _KEYS:
        for extra in now:
            if _current(obj, extra) is not MISSING or extra in getattr(obj, "_buffers", {}):
                delattr(obj, extra)
    else:
        _put(obj, name, (_like(old[0], now[0]), old[1]))


def _reapply(obj: Any, name: Any, now: Any) -> None:
    if name == "__class__":
        obj.__class__ = now
    elif name is _KEYS:
        for extra, held in now.items():
            _put(obj, extra, held)
    else:
        _put(obj, name, now)


@contextlib.contextmanager
def _finishing() -> Iterator[Callable[..., Any]]:
    """`finish(step, *args)` runs a step of an undo or redo; a KeyboardInterrupt inside it is held, the step run
    again, and the interrupt raised once the whole undo or redo is done: an interrupted undo would leave the model
    neither patched nor not."""
    held: list[BaseException] = []

    def finish(step: Callable[..., Any], *args: Any) -> Any:
        try:
            return step(*args)
        except KeyboardInterrupt as e:
            held.append(e)
            return step(*args)

    yield finish
    if held:
        raise held[0]


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold SIGINT (Ctrl-C) back until the block is done, then deliver it as the handler in place would have. Only
    the main thread receives signals, so elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received and callable(previous):
            previous(signal.SIGINT, received[0])
        elif received and previous == signal.SIG_DFL:
            raise KeyboardInterrupt


def _current(obj: Any, name: Any) -> Any:
    # Read instance state only: a class attribute or property is not something we replaced.
    if name in getattr(obj, "_buffers", {}):
        return obj._buffers[name]
    if name in getattr(obj, "_modules", {}):
        return obj._modules[name]
    if name in getattr(obj, "_parameters", {}):
        return obj._parameters[name]
    d = getattr(obj, "__dict__", {})
    # PretrainedConfig maps legacy names (e.g. GPT-2's n_positions) through attribute_map.
    amap = d.get("attribute_map") or getattr(type(obj), "attribute_map", {}) or {}
    name = amap.get(name, name)
    return d.get(name, MISSING)


def _held(obj: Any, name: Any) -> tuple[Any, str | None]:
    """(value or MISSING, its slot): "buffer" (persistent), "buffer-np" (non-persistent), "parameter", "module" or
    None (a plain attribute, or absent), so that undo/redo put a value back where it was."""
    for slot, table in (("buffer", "_buffers"), ("parameter", "_parameters"), ("module", "_modules")):
        if name in getattr(obj, table, {}):
            if slot == "buffer" and name in obj._non_persistent_buffers_set:
                slot = "buffer-np"
            return getattr(obj, table)[name], slot
    return _current(obj, name), None


def _put(obj: Any, name: Any, held: Any) -> None:
    """Put `held` (from _held) back: the value in its own kind of slot, or nothing if it was MISSING. A value of
    another kind there now is removed first (nn.Module refuses e.g. a plain value over a submodule)."""
    value, slot = held
    if _current(obj, name) is not MISSING and (value is MISSING or _held(obj, name)[1] != slot):
        delattr(obj, name)
    if value is MISSING:
        return
    if slot in ("buffer", "buffer-np") and name not in obj._buffers:
        obj.register_buffer(name, value, persistent=slot == "buffer")
    else:
        setattr(obj, name, value)


_SUBCLASSES: dict[tuple[type, type, bool], type] = {}


def with_mixin(cls: type, mixin: type, under: bool = False) -> type:
    """A subclass of `cls` with `mixin`'s methods first; one class per pair, reused across patches (so that a
    class created for one layer is the class of every patched layer of that type).

    under=True: `mixin` subclasses one of cls's bases and must come right after cls instead, so that cls's own
    methods still run and reach the mixin through super() (OPT's position table computes positions, then calls
    nn.Embedding.forward: a mixin of nn.Embedding placed under it replaces just the lookup)."""
    key = (cls, mixin, under)
    if key not in _SUBCLASSES:
        bases = (mixin, cls) if not under else ((mixin,) if issubclass(mixin, cls) or mixin.__mro__[1] is cls
                                                 else (cls, mixin))
        _SUBCLASSES[key] = type(f"{mixin.__name__}_{cls.__name__}", bases, {"__module__": mixin.__module__})
    return _SUBCLASSES[key]


def without_mixin(cls: type, mixin: type) -> type:
    """The class `with_mixin(base, mixin)` made `cls` from (under=False: its bases are `(mixin, base)`)."""
    if len(cls.__bases__) != 2 or cls.__bases__[0] is not mixin:
        raise TypeError(f"{cls.__name__} is not a class with_mixin made with {mixin.__name__}")
    return cls.__bases__[1]


def _like(old: Any, now: Any) -> Any:
    """The saved tensor or module, moved to the device and floating dtype its replacement has now: the model may
    have been moved (`model.to("cuda")`, `model.bfloat16()`) between patch and unpatch, and the saved objects were
    not in the model then."""
    if isinstance(old, torch.nn.Module) and isinstance(now, torch.nn.Module):
        target, have = _float_tensor(now), _float_tensor(old)
        if target is not None and have is not None and (have.dtype, have.device) != (target.dtype, target.device):
            old.to(device=target.device, dtype=target.dtype)
        return old
    if not (isinstance(old, torch.Tensor) and isinstance(now, torch.Tensor)):
        return old
    if old.device == now.device and (old.dtype == now.dtype or not now.is_floating_point()):
        return old
    moved = old.to(device=now.device, dtype=now.dtype if now.is_floating_point() else old.dtype)
    return torch.nn.Parameter(moved, requires_grad=old.requires_grad) if isinstance(old, torch.nn.Parameter) else moved


def _keys(obj: Any) -> frozenset:
    return frozenset(getattr(obj, "__dict__", {})) | frozenset(getattr(obj, "_buffers", {}))


def _float_tensor(module: nn.Module) -> torch.Tensor | None:
    """The first floating-point parameter or buffer of a module (None if it has none)."""
    for t in list(module.parameters()) + list(module.buffers()):
        if t.is_floating_point():
            return t
    return None
