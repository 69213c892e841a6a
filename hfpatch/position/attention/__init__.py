"""Attention functions that the position schemes plug into transformers' AttentionInterface, and how each call is
routed: the per-call choice among a scheme's ways to compute it (paths), the kernels (kernels: sdpa / flash pieces,
flex: compiled flex_attention, split: attention over key ranges merged by log-sum-exp), attention with the scores
written out (written), and the query scale of attention_temperature= (temperature).
"""
