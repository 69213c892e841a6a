from .base import Adapter

ADAPTER = Adapter(
    model_type="llama",
    layers="layers",
    attention="self_attn",
    norms=("input_layernorm", "post_attention_layernorm"),
    final_norm="norm",
    rotary="rotary_emb",
)
