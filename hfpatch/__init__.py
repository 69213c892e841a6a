"""hfpatch: change how a pretrained transformers model normalizes and encodes position, in one call.

The public API is loaded on first use (PEP 562), so that `import hfpatch` — and the `hfpatch` command's `--help` —
does not pay for importing torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.3.0"

# public name -> the module that defines it
_API = {"patch": "apply", "unpatch": "apply", "describe": "introspect", "calibrate": "apply",
        "supported": "families", "save_pretrained": "interop.io", "from_pretrained": "interop.io"}
__all__ = ["spec", "patch", "unpatch", "describe", "calibrate", "supported", "save_pretrained", "from_pretrained",
           "__version__"]

if TYPE_CHECKING:
    from . import spec
    from .apply import calibrate, patch, unpatch
    from .families import supported
    from .interop.io import from_pretrained, save_pretrained
    from .introspect import describe


def __getattr__(name: str) -> Any:
    if name == "spec" or name in _API:
        module = importlib.import_module(f".{_API.get(name, name)}", __name__)
        value = module if name == "spec" else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hfpatch' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
