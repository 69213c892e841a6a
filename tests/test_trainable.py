"""A patch keeps what the user froze: a parameter a norm swap creates or converts is trainable exactly where the one
it replaces was (a new bias follows its module's weight), and unpatch gives back the original parameters with their
own flags."""

from __future__ import annotations

import warnings

import pytest
from peft import LoraConfig, get_peft_model

import hfpatch
from hfpatch import tiny


def _trainable(model) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def _frozen(model_type: str):
    model = tiny.build_tiny(model_type)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@pytest.mark.parametrize("norm", ["layernorm", "batchnorm"])
def test_a_plain_norm_swap_on_a_frozen_model_makes_nothing_trainable(norm):
    model = _frozen("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the plain-swap warning
        hfpatch.patch(model, norm=norm)
    assert hfpatch.describe(model)["norm"]["kind"] == norm
    assert _trainable(model) == set()
    hfpatch.unpatch(model)
    assert _trainable(model) == set()


def test_the_exact_rmsnorm_conversion_of_a_frozen_gpt2_adds_no_trainable_bias():
    # The conversion gives the LM head a bias (it carries the final norm's β): frozen like the head's weight.
    model = _frozen("gpt2")
    assert model.lm_head.bias is None
    hfpatch.patch(model, norm="rmsnorm")
    assert hfpatch.describe(model)["norm"]["exact"] is True
    assert model.lm_head.bias is not None and not model.lm_head.bias.requires_grad
    assert _trainable(model) == set()


def test_only_the_norms_trainable_stay_the_only_trainable_ones_through_an_exact_conversion():
    model = _frozen("gpt2")
    for name, p in model.named_parameters():
        if ".ln_" in name:
            p.requires_grad_(True)
    before = _trainable(model)
    hfpatch.patch(model, norm="rmsnorm")
    after = _trainable(model)
    # the block norms' weights (now unit RMSNorm scales) stay trainable; their biases are folded away, and nothing
    # the conversion rewrote (the frozen linear layers, the head and its new bias) became trainable
    assert after and all(".ln_" in name and name.endswith(".weight") for name in after)
    assert not model.lm_head.bias.requires_grad
    hfpatch.unpatch(model)
    assert _trainable(model) == before


def test_a_lora_model_keeps_its_trainable_tensors_through_a_norm_swap_and_unpatch():
    model = get_peft_model(tiny.build_tiny("llama"), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    before = _trainable(model)
    assert before and all("lora_" in name for name in before)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hfpatch.patch(model, norm="layernorm")
    assert _trainable(model) == before
    hfpatch.unpatch(model)
    assert _trainable(model) == before


def test_a_trainable_model_stays_trainable_and_its_new_norm_bias_too():
    model = tiny.build_tiny("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hfpatch.patch(model, norm="layernorm")
    norm = model.model.layers[0].input_layernorm
    assert norm.weight.requires_grad and norm.bias.requires_grad
    assert _trainable(model) == {name for name, _ in model.named_parameters()}
