from .base import Adapter

ADAPTER = Adapter(
    model_type="olmo2",
    layers="layers",
    attention="self_attn",
    mlp="mlp",
    norms=("post_attention_layernorm", "post_feedforward_layernorm"),
    qk_norms=("self_attn.q_norm", "self_attn.k_norm"),
    final_norm="norm",
    placement="post_sublayer",
    rotary="rotary_emb",
)
