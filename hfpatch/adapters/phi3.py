from .base import Adapter

ADAPTER = Adapter(
    model_type="phi3",
    layers="layers",
    attention="self_attn",
    norms=("input_layernorm", "post_attention_layernorm"),
    mlp="mlp",
    final_norm="norm",
    residual_readers={"input_layernorm": ("self_attn.qkv_proj",), "post_attention_layernorm": ("mlp.gate_up_proj",)},
    residual_writers=("self_attn.o_proj", "mlp.down_proj"),
    embedding_writers=("embed_tokens",),
    placement_layout="llama",
    rotary="rotary_emb",
    # Phi3Config rejects every other rope_type (and rewrites "yarn" to "longrope" on load), so other schemes are
    # saved in the hfpatch section only.
    native_rope_types=frozenset({"default", "longrope"}),
)
