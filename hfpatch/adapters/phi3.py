from .base import Adapter

ADAPTER = Adapter(
    model_type="phi3",
    layers="layers",
    attention="self_attn",
    norms=("input_layernorm", "post_attention_layernorm"),
    final_norm="norm",
    rotary="rotary_emb",
    # Phi3Config rejects every other rope_type (and rewrites "yarn" to "longrope" on load), so other schemes are
    # saved in the hfpatch section only.
    native_rope_types=frozenset({"default", "longrope"}),
)
