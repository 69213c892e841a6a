"""Position schemes: the registry (schemes.py), RoPE builders (rope.py), application (patch.py, rotary.py), ALiBi
(alibi.py), absolute tables (absolute.py)."""

from .schemes import SCHEMES, Scheme, options_of

__all__ = ["SCHEMES", "Scheme", "options_of"]
