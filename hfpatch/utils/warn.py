"""Warnings that point at the user's line: the first frame outside the hfpatch package, however deep inside it the
warning is raised (a fixed stacklevel breaks whenever a call path gains or loses a function)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from types import FrameType

_PACKAGE = str(Path(__file__).resolve().parents[1])  # hfpatch/, this module being in hfpatch/utils/


class NeedsCalibrationWarning(UserWarning):
    """A patch whose new modules leave the model unusable until hfpatch.calibrate (or training) sets them: BatchNorm's
    fresh running statistics. A caller that calibrates right after patching may filter it."""


def warn_caller(message: str, category: type[Warning] = UserWarning) -> None:
    level = 2  # stacklevel 2: warn_caller's caller
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
