from .base import LLAMA_STYLE, Adapter

ADAPTER = Adapter(model_type="llama", **LLAMA_STYLE)
