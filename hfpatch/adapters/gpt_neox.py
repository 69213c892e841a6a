from .base import Adapter

ADAPTER = Adapter(
    model_type="gpt_neox",
    layers="layers",
    attention="attention",
    norms=("input_layernorm", "post_attention_layernorm"),
    mlp="mlp",
    final_norm="final_layer_norm",
    norm="layernorm",
    residual_readers={
        "input_layernorm": ("attention.query_key_value",),
        "post_attention_layernorm": ("mlp.dense_h_to_4h",),
    },
    residual_writers=("attention.dense", "mlp.dense_4h_to_h"),
    embedding_writers=("embed_in",),
    # parallel residual (the default) has no post-norm form of its own: placement="post" makes blocks sequential
    placement_layout="gpt_neox",
    rotary="rotary_emb",  # partial rotary: only the first rotary_pct of each head rotates
)
