"""The position schemes that change more than RoPE's frequencies: absolute tables (absolute, learned), ALiBi (alibi),
T5 and Transformer-XL relative encodings (relative), and the schemes that rotate queries and keys themselves
(rotated: Self-Extend in self_extend, Dual Chunk Attention in dual_chunk).
"""
