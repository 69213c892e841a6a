"""hfpatch: change how a pretrained transformers model normalizes and encodes position, in one call."""

from . import spec
from .apply import describe, patch, unpatch
from .families import supported
from .io import from_pretrained, save_pretrained

__version__ = "0.3.0"
__all__ = ["spec", "patch", "unpatch", "describe", "supported", "save_pretrained", "from_pretrained", "__version__"]
