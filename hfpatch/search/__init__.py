"""hfpatch search: the training-free patch that works best for a model at a target length, found by an
evolutionary search (LongRoPE's per-pair RoPE factors, and the settings of YaRN, Self-Extend and Dual Chunk
Attention) scored by needle-driven perplexity (LongRoPE2), ranked on short proxy samples whose position ids span the
target length and decided at full length. options.py: what it takes, declared once; space.py: candidates and their
constraints; objective.py: what a candidate is scored by; loop.py: the resumable search; api.py: search() and its
outputs; report.py: its table and plot; command.py: the `hfpatch search` command.

Importing the package loads no torch: `search` is imported on first use (the command's --help answers at once).
"""

from __future__ import annotations

from typing import Any

from .options import Budget, SearchOptions, parse_budget

__all__ = ["Budget", "SearchOptions", "parse_budget", "search"]


def __getattr__(name: str) -> Any:
    if name == "search":
        from .api import search  # torch and transformers: imported when a search is run

        return search
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
