from .base import Adapter

ADAPTER = Adapter(
    model_type="gpt2",
    layers="h",
    attention="attn",
    norms=("ln_1", "ln_2"),
    final_norm="ln_f",
    norm="layernorm",
    position_table="wpe",
)
