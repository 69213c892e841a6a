from .base import Adapter

ADAPTER = Adapter(
    model_type="qwen3",
    layers="layers",
    attention="self_attn",
    norms=("input_layernorm", "post_attention_layernorm"),
    qk_norms=("self_attn.q_norm", "self_attn.k_norm"),
    final_norm="norm",
    rotary="rotary_emb",
)
