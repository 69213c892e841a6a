from .base import Adapter

ADAPTER = Adapter(
    model_type="gpt_neox",
    layers="layers",
    attention="attention",
    norms=("input_layernorm", "post_attention_layernorm"),
    final_norm="final_layer_norm",
    norm="layernorm",
    rotary="rotary_emb",  # partial rotary: only the first rotary_pct of each head rotates
)
