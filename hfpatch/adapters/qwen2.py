from .base import LLAMA_STYLE, Adapter

ADAPTER = Adapter(model_type="qwen2", **LLAMA_STYLE)
