"""Every adapter's paths point at real modules of its family, and together cover every norm of the base model."""

import pytest
import torch
from conftest import FAMILIES, tiny_model

from hfpatch.adapters import ADAPTERS, adapter_for
from hfpatch.apply import get_path


def test_one_adapter_per_spec_family():
    assert sorted(ADAPTERS) == sorted(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_paths_resolve(family):
    model = tiny_model(family)
    adapter = adapter_for(model.config)
    base = model.base_model
    layers = get_path(base, adapter.layers)
    assert len(layers) == model.config.num_hidden_layers
    for layer in layers:
        assert "attention" in type(get_path(layer, adapter.attention)).__name__.lower()
        for name in adapter.norms + adapter.qk_norms:
            assert "norm" in type(get_path(layer, name)).__name__.lower(), name
    if adapter.rotary:
        assert "rotary" in type(get_path(base, adapter.rotary)).__name__.lower()
    if adapter.position_table:
        table = get_path(base, adapter.position_table)
        assert isinstance(table, torch.nn.Embedding)
        assert table.num_embeddings >= model.config.max_position_embeddings


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_covers_every_norm(family):
    model = tiny_model(family)
    adapter = adapter_for(model.config)
    prefix = model.base_model_prefix + "."
    declared = set()
    for i in range(model.config.num_hidden_layers):
        declared |= {f"{prefix}{adapter.layers}.{i}.{n}" for n in adapter.norms + adapter.qk_norms}
    declared |= {prefix + p for p in (adapter.final_norm, adapter.embedding_norm) if p}
    declared |= set(adapter.head_norms)
    present = {n for n, m in model.named_modules() if "norm" in type(m).__name__.lower()}
    assert present == declared


def test_unknown_model_type():
    class Config:
        model_type = "falcon"

    with pytest.raises(ValueError, match="model_type 'falcon'; supported: bert, gemma, gemma2, gemma3_text, gpt2"):
        adapter_for(Config())
