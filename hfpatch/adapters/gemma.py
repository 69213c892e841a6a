from .base import Adapter

ADAPTER = Adapter(
    model_type="gemma",
    layers="layers",
    attention="self_attn",
    norms=("input_layernorm", "post_attention_layernorm"),
    final_norm="norm",
    norm="gemma_rmsnorm",
    rotary="rotary_emb",
)
