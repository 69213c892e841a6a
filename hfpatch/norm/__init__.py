"""Norms: the registry of kinds (kinds.py), hfpatch's own norm modules (modules.py), the swap and the exact
LayerNorm -> RMSNorm conversion (convert.py, exact.py), BatchNorm's padding record (batchnorm.py), pre/post placement
(placement.py)."""

from .kinds import NORMS

__all__ = ["NORMS"]
