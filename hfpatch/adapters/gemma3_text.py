from .base import Adapter

ADAPTER = Adapter(
    model_type="gemma3_text",
    layers="layers",
    attention="self_attn",
    mlp="mlp",
    norms=("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"),
    qk_norms=("self_attn.q_norm", "self_attn.k_norm"),
    final_norm="norm",
    norm_offset=1.0,
    placement="sandwich",
    rotary="rotary_emb",
    rope_layer_types=("full_attention",),
)
