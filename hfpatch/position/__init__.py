"""Position schemes: the registry (schemes.py), RoPE builders (rope.py), application (patch.py, rotary.py), ALiBi
(alibi.py), absolute tables (absolute.py), T5 and Transformer-XL relative encodings (relative.py), a new learned
table (learned.py), Self-Extend (self_extend.py), attention with the scores written out (attention.py). Nothing is imported here, so that adapter
inference can use rotary.py and absolute.py without the registry (which needs the adapters)."""
