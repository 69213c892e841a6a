from .base import Adapter

ADAPTER = Adapter(
    model_type="gpt2",
    layers="h",
    attention="attn",
    norms=("ln_1", "ln_2"),
    mlp="mlp",
    final_norm="ln_f",
    norm="layernorm",
    residual_readers={"ln_1": ("attn.c_attn",), "ln_2": ("mlp.c_fc",)},  # Conv1D: weights stored [in, out]
    residual_writers=("attn.c_proj", "mlp.c_proj"),
    embedding_writers=("wte", "wpe"),
    placement_layout="gpt2",
    position_table="wpe",
)
