from .base import LLAMA_STYLE, Adapter

# Gemma norms scale by 1 + weight; its embeddings are scaled by sqrt(hidden) (still a linear writer).
ADAPTER = Adapter(model_type="gemma", norm_offset=1.0, **LLAMA_STYLE)
