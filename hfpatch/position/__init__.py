"""Position schemes: the registry of schemes, one record each (registry.py), what a scheme needs of a model
(requirements.py), the checks of numeric options (checks.py), the RoPE rescaling applier and the schemes that put
another signal in (signal.py), per-layer positions (layers.py), and what `hfpatch search` varies of a scheme
(search_space.py; hfpatch's own spaces in spaces.py). Below them, three folders: rope/ (RoPE as transformers computes
it: the builders of rope_parameters, the live rotary module, the GGUF forms, what serving engines read), attention/
(the attention functions plugged into transformers, their paths and kernels) and schemes/ (the schemes that change
more than RoPE's frequencies: absolute and learned tables, ALiBi, T5 and Transformer-XL, Self-Extend and Dual Chunk
Attention, and taking a model's own position signal out). What the adapters know of a model's own position signal
is in adapters/infer/positions.py, below all of these."""

from .registry import SCHEMES

__all__ = ["SCHEMES"]
