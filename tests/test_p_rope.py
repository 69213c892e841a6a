"""position="p-rope" (Barbero et al. 2025): the highest-frequency fraction `keep` of the rotary pairs rotates, the
others carry no position. Checked against the paper's formula in float64, against transformers' own "proportional"
RoPE where that is native, through save/reload, unpatch, cached decoding, and on partial and per-layer-type RoPE."""

import math

import pytest
import torch
from conftest import ROPE_FAMILIES, logits, max_diff, tiny_model, tokens
from handref import cached_and_full
from transformers import AutoModelForCausalLM

import hfpatch


def rotary_of(model):
    return model.base_model.rotary_emb


def paper_cos_sin(theta: float, rotary_dim: int, keep: float, positions: torch.Tensor):
    """The paper's p-RoPE in float64: frequencies theta^(-2i/d), i < d/2; the floor(keep * d/2) highest keep theirs,
    the others are 0; cos and sin of position x frequency, each pair's two channels alike."""
    half = rotary_dim // 2
    freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / rotary_dim)
    freq[int(keep * half):] = 0.0
    angles = positions.double()[:, None] * freq[None]
    emb = torch.cat([angles, angles], -1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("family,keep", [("llama", 0.75), ("llama", 0.5), ("gpt_neox", 0.5), ("phi", 0.5)])
def test_p_rope_rotary_equals_the_papers_formula(family, keep):
    model = hfpatch.patch(tiny_model(family), position="p-rope", keep=keep)
    params = model.config.rope_parameters
    head = model.config.hidden_size // model.config.num_attention_heads
    rotary_dim = int(head * params.get("partial_rotary_factor", 1.0)) if params["rope_type"] != "proportional" \
        else head
    positions = torch.arange(0, 300, 7)
    x = torch.zeros(1, len(positions), model.config.hidden_size)
    cos, sin = rotary_of(model)(x, positions[None])
    want_cos, want_sin = paper_cos_sin(params["rope_theta"], rotary_dim, keep, positions)
    assert cos.shape[-1] == rotary_dim
    assert torch.allclose(cos[0].double(), want_cos, atol=1e-5)
    assert torch.allclose(sin[0].double(), want_sin, atol=1e-5)


def test_p_rope_is_transformers_proportional_rope_where_native(tmp_path):
    """A model that rotates every channel carries p-RoPE natively: plain transformers reloads it as it is, and
    equals a model transformers builds itself with rope_type="proportional"."""
    model = hfpatch.patch(tiny_model("llama"), position="p-rope", keep=0.75)
    assert hfpatch.describe(model)["position"]["native"] is True
    ids = tokens(120)
    hfpatch.save_pretrained(model, tmp_path / "p")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "p").eval()
    assert plain.config.rope_parameters["rope_type"] == "proportional"
    assert max_diff(logits(plain, ids), logits(model, ids)) == 0.0


def test_p_rope_on_a_partial_rotation_reloads_patched_through_hfpatch(tmp_path):
    model = hfpatch.patch(tiny_model("gpt_neox"), position="p-rope", keep=0.5)
    assert hfpatch.describe(model)["position"]["native"] is False
    ids = tokens(120)
    hfpatch.save_pretrained(model, tmp_path / "p")
    again = hfpatch.from_pretrained(tmp_path / "p")
    assert hfpatch.describe(again)["position"]["scheme"] == "p-rope"
    assert max_diff(logits(again, ids), logits(model, ids)) == 0.0


@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_p_rope_unpatches_exactly_and_keep_one_changes_nothing(family):
    model = tiny_model(family)
    ids = tokens(100)
    before = logits(model, ids)
    hfpatch.patch(model, position="p-rope", keep=1.0)
    assert max_diff(logits(model, ids), before) == 0.0
    hfpatch.patch(model, position="p-rope", keep=0.5)
    assert max_diff(logits(model, ids), before) > 0.0
    hfpatch.unpatch(model)
    assert max_diff(logits(model, ids), before) == 0.0


def test_p_rope_cached_decoding_equals_the_full_forward():
    model = hfpatch.patch(tiny_model("llama"), position="p-rope", keep=0.5)
    cached, full, same = cached_and_full(model)
    assert max_diff(cached, full) < 1e-5
    assert same


def test_p_rope_on_per_layer_type_rope_changes_only_the_global_layers():
    model = hfpatch.patch(tiny_model("gemma3_text"), position="p-rope", keep=0.5)
    rotary = next(m for m in model.modules() if hasattr(m, "full_attention_inv_freq"))
    full, local = rotary.full_attention_inv_freq, rotary.sliding_attention_inv_freq
    half = full.numel()
    assert int(full.count_nonzero()) == int(0.5 * half)
    assert int(local.count_nonzero()) == local.numel()


@pytest.mark.parametrize("keep", [0.0, 1.5, -0.2, math.nan, "half"])
def test_p_rope_refuses_a_keep_outside_zero_to_one(keep):
    model = tiny_model("llama")
    with pytest.raises((ValueError, TypeError), match="keep"):
        hfpatch.patch(model, position="p-rope", keep=keep)
    assert "applied" not in hfpatch.describe(model) or not hfpatch.describe(model)["applied"]


def test_p_rope_refuses_a_keep_that_leaves_no_pair_and_leaves_the_model_as_it_was():
    model = tiny_model("gpt_neox")  # a partial rotation: few pairs
    pairs = rotary_of(model).inv_freq.numel()
    ids = tokens(60)
    before = logits(model, ids)
    with pytest.raises(ValueError, match="leaves no rotary pair"):
        hfpatch.patch(model, position="p-rope", keep=0.9 / pairs)
    assert max_diff(logits(model, ids), before) == 0.0
    assert hfpatch.describe(model)["position"]["scheme"] == "rope"
