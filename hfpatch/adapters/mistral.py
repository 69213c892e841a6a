from .base import LLAMA_STYLE, Adapter

ADAPTER = Adapter(model_type="mistral", **LLAMA_STYLE)
