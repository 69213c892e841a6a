"""hfpatch search: the training-free patch that works best for a model at a target length, found by an
evolutionary search (LongRoPE's per-pair RoPE factors, and the settings of YaRN, Self-Extend and Dual Chunk
Attention) scored by needle-driven perplexity (LongRoPE2). space.py: candidates and their constraints;
objective.py: what a candidate is scored by; loop.py: the resumable search and its outputs; command.py: the
`hfpatch search` command."""

from __future__ import annotations

from .loop import Budget, parse_budget, search

__all__ = ["Budget", "parse_budget", "search"]
