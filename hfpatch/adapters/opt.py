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
    position_table="decoder.embed_positions",  # OPTLearnedPositionalEmbedding: rows offset by 2
)
