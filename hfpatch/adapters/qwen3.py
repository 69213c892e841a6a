from .base import LLAMA_STYLE, Adapter

ADAPTER = Adapter(model_type="qwen3", qk_norms=("self_attn.q_norm", "self_attn.k_norm"), **LLAMA_STYLE)
