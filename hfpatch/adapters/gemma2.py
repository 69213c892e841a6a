from .base import Adapter

ADAPTER = Adapter(
    model_type="gemma2",
    layers="layers",
    attention="self_attn",
    mlp="mlp",
    norms=("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"),
    final_norm="norm",
    norm_offset=1.0,
    placement="sandwich",
    rotary="rotary_emb",
)
