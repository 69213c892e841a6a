from .base import Adapter

ADAPTER = Adapter(
    model_type="qwen2",
    layers="layers",
    attention="self_attn",
    norms=("input_layernorm", "post_attention_layernorm"),
    final_norm="norm",
    rotary="rotary_emb",
)
