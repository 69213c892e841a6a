from .base import Adapter

ADAPTER = Adapter(
    model_type="bert",
    layers="encoder.layer",
    attention="attention.self",
    norms=("attention.output.LayerNorm", "output.LayerNorm"),
    embedding_norm="embeddings.LayerNorm",
    head_norms=("cls.predictions.transform.LayerNorm",),  # BertForMaskedLM / BertForPreTraining / BertLMHeadModel
    norm="layernorm",
    placement="post",
    placement_layout="bert",
    position_table="embeddings.position_embeddings",
    causal=False,
)
