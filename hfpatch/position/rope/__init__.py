"""RoPE as transformers computes it: one pure builder per scheme into transformers' rope_parameters (builders), and
putting those parameters into a live rotary module (rotary).
"""
