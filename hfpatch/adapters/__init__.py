"""One adapter per `model_type`: where norms, attention, the rotary module and position tables live.

Adding a family is adding one file to this folder that defines `ADAPTER = Adapter(...)`.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import Adapter, get_path

ADAPTERS: dict[str, Adapter] = {}
for _info in pkgutil.iter_modules(__path__):
    if _info.name != "base":
        _adapter = importlib.import_module(f"{__name__}.{_info.name}").ADAPTER
        ADAPTERS[_adapter.model_type] = _adapter


def adapter_for(model) -> Adapter:
    """The adapter for a model (or its config); ValueError naming the type and the supported ones otherwise."""
    config = getattr(model, "config", model)
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        raise ValueError(
            f"hfpatch does not support model_type {model_type!r}; supported: {', '.join(sorted(ADAPTERS))}"
        )
    return ADAPTERS[model_type]


__all__ = ["ADAPTERS", "Adapter", "adapter_for", "get_path"]
