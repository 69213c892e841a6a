"""Attention functions that the position schemes plug into transformers' AttentionInterface, and how each call is
routed: the per-call choice among a scheme's ways to compute it (paths), the kernels (kernels: sdpa / flash pieces,
flex: compiled flex_attention, fa4: FlashAttention-4, split: attention over key ranges merged by log-sum-exp),
attention as kernel calls merged by log-sum-exp with their backward (pieces), a learned distance bias's gradient
from its band (distance_bias), scores no kernel computes, recomputed in the backward pass (recompute), attention
with the scores written out (written), and the query scale of attention_temperature= (temperature).
"""
