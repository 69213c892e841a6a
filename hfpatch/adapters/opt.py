from .base import Adapter

ADAPTER = Adapter(
    model_type="opt",
    layers="decoder.layers",
    attention="self_attn",
    norms=("self_attn_layer_norm", "final_layer_norm"),
    final_norm="decoder.final_layer_norm",
    norm="layernorm",
    # opt-350m normalizes after the residual add; every other OPT size before it.
    placement=lambda config: "pre" if getattr(config, "do_layer_norm_before", True) else "post",
    residual_readers={
        "self_attn_layer_norm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "final_layer_norm": ("fc1",),
    },
    residual_writers=("self_attn.out_proj", "fc2"),
    # with word_embed_proj_dim != hidden_size, project_in writes the stream and project_out reads the final norm
    embedding_writers=("decoder.project_in|decoder.embed_tokens", "decoder.embed_positions"),
    final_readers=("decoder.project_out",),
    position_table="decoder.embed_positions",  # OPTLearnedPositionalEmbedding: rows offset by 2
    position_offset=2,
)
