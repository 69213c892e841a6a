from .base import Adapter

ADAPTER = Adapter(
    model_type="gemma",
    layers="layers",
    attention="self_attn",
    norms=("input_layernorm", "post_attention_layernorm"),
    final_norm="norm",
    norm_offset=1.0,
    residual_readers={
        "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
    },
    residual_writers=("self_attn.o_proj", "mlp.down_proj"),
    embedding_writers=("embed_tokens",),
    placement_layout="llama",
    rotary="rotary_emb",
)
