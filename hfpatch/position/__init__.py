"""Position schemes: the registry (schemes.py), RoPE builders (rope.py), application (patch.py, rotary.py), ALiBi
(alibi.py), absolute tables (absolute.py), T5 and Transformer-XL relative encodings (relative.py), a new learned
table (learned.py), attention with the scores written out (biased.py)."""

from .schemes import SCHEMES, Scheme, options_of

__all__ = ["SCHEMES", "Scheme", "options_of"]
