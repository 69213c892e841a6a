"""The one layer of hfpatch that changes live objects.

Every change a patch makes to a model (an attribute, a buffer, a config field, an instance's class) goes through
an `Edits` log that remembers what was there before. That gives us, for free:
- all-or-nothing patching: if anything fails half-way, `undo()` puts back every change already made;
- exact `unpatch`: the original tensors and objects are restored themselves, not recomputed (diff 0.0).
"""

from __future__ import annotations

_MISSING = object()
_KEYS = object()  # log marker: the set of attribute names an object had


class Edits:
    """An ordered log of reversible changes."""

    def __init__(self):
        self._log: list[tuple[object, str, object]] = []  # (target, attribute, previous value or _MISSING)

    def __len__(self):
        return len(self._log)

    def set(self, obj, name: str, value) -> None:
        """setattr(obj, name, value), remembering the old value (or its absence).

        On an nn.Module, assigning a tensor to a registered buffer's name replaces the buffer and keeps its
        persistence, so buffers need no special case.
        """
        self._log.append((obj, name, _current(obj, name)))
        setattr(obj, name, value)

    def delete(self, obj, name: str) -> None:
        """delattr(obj, name) if it exists, remembering the value."""
        old = _current(obj, name)
        if old is _MISSING:
            return
        self._log.append((obj, name, old))
        delattr(obj, name)

    def swap_class(self, obj, cls: type) -> None:
        """Give one instance a new class (a subclass of its own), so that class-level machinery such as
        gradient checkpointing keeps wrapping the new forward (replacing `obj.forward` would bypass it)."""
        if not issubclass(cls, type(obj)):
            raise TypeError(f"{cls.__name__} must subclass {type(obj).__name__}")
        self._log.append((obj, "__class__", type(obj)))
        obj.__class__ = cls

    def mix_in(self, obj, mixin: type, under: bool = False) -> None:
        """swap_class to a subclass of obj's class with `mixin`'s methods first (see `with_mixin` for `under`)."""
        self.swap_class(obj, with_mixin(type(obj), mixin, under))

    def track_new_attributes(self, obj) -> None:
        """On undo, also drop attributes and buffers that appear on `obj` after this point, e.g. the caches
        transformers' dynamic RoPE update adds while the patched model runs."""
        self._log.append((obj, _KEYS, _keys(obj)))

    def touched(self, obj) -> dict[str, object]:
        """{attribute: original value} for every attribute of `obj` this log changed (first value wins)."""
        out: dict[str, object] = {}
        for target, attr, old in self._log:
            if target is obj and attr is not _KEYS and attr not in out:
                out[attr] = old
        return out

    def undo(self) -> None:
        """Revert every change, newest first. The log is empty afterwards."""
        while self._log:
            obj, name, old = self._log.pop()
            if name == "__class__":
                obj.__class__ = old
            elif name is _KEYS:
                for extra in _keys(obj) - old:
                    delattr(obj, extra)
            elif old is _MISSING:
                if _current(obj, name) is not _MISSING:
                    delattr(obj, name)
            else:
                setattr(obj, name, _like(old, _current(obj, name)))


def _current(obj, name):
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
    return d.get(name, _MISSING)


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


def _like(old, now):
    """The saved tensor, moved to the device and dtype its replacement has now: the model may have been moved
    (`model.to("cuda")`, `model.bfloat16()`) between patch and unpatch."""
    import torch

    if not (isinstance(old, torch.Tensor) and isinstance(now, torch.Tensor)):
        return old
    if old.device == now.device and (old.dtype == now.dtype or not now.is_floating_point()):
        return old
    moved = old.to(device=now.device, dtype=now.dtype if now.is_floating_point() else old.dtype)
    return torch.nn.Parameter(moved, requires_grad=old.requires_grad) if isinstance(old, torch.nn.Parameter) else moved


def _keys(obj) -> frozenset:
    return frozenset(getattr(obj, "__dict__", {})) | frozenset(getattr(obj, "_buffers", {}))
