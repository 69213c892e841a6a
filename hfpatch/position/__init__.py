"""Position schemes: the registry (schemes.py), RoPE builders (rope.py), application (patch.py, rotary.py), ALiBi
(alibi.py), absolute tables (absolute.py), T5 and Transformer-XL relative encodings (relative.py), a new learned
table (learned.py), Self-Extend (self_extend.py), attention with the scores written out (attention.py). What the
adapters know of a model's own position signal is in adapters/positions.py, below all of these."""

from .registry import SCHEMES

__all__ = ["SCHEMES"]
