"""Moved to `hfpatch.interop.gguf`; this re-export stays for one version (hfpatch 0.4 removes it)."""

import warnings

from .interop.gguf import *  # noqa: F403

warnings.warn("hfpatch.gguf moved to hfpatch.interop.gguf; import it from there (the old path goes in hfpatch 0.4)",
              DeprecationWarning, stacklevel=2)
