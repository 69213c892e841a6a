"""Moved to `hfpatch.interop.io`; this re-export stays for one version (hfpatch 0.4 removes it)."""

import warnings

from .interop.io import *  # noqa: F403

warnings.warn("hfpatch.io moved to hfpatch.interop.io; import it from there (the old path goes in hfpatch 0.4)",
              DeprecationWarning, stacklevel=2)
