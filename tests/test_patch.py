"""patch / unpatch / describe as a whole: exact unpatch, idempotence, replacement without stacking, clear errors
that leave the model exactly as it was, peft models."""

import dataclasses
import math

import pytest
import torch
from conftest import (
    FAMILIES,
    ROPE_FAMILIES,
    WINDOW,
    assert_same_fingerprint,
    fingerprint,
    logits,
    max_diff,
    native_model,
    tiny_model,
    tokens,
)
from transformers import AutoConfig, AutoModelForCausalLM

import hfpatch
import hfpatch.apply
from hfpatch.apply import PatchRefused
from hfpatch.position import registry as schemes

SCHEMES = [
    dict(position="linear", factor=2.0),
    dict(position="ntk", factor=2.0),
    dict(position="dynamic", factor=2.0),
    dict(position="yarn", factor=4.0),
    dict(position="dynamic-yarn"),
    dict(position="llama3", factor=4.0),
]


@pytest.mark.parametrize("family", ROPE_FAMILIES)
@pytest.mark.parametrize("kwargs", SCHEMES, ids=lambda k: k["position"])
def test_unpatch_restores_exactly(family, kwargs):
    model = tiny_model(family)
    x = tokens(160)
    before, fp = logits(model, x), fingerprint(model)
    hfpatch.patch(model, **kwargs)
    assert max_diff(logits(model, x), before) > 0
    hfpatch.unpatch(model)
    assert max_diff(logits(model, x), before) == 0.0
    assert_same_fingerprint(fingerprint(model), fp)
    assert hfpatch.describe(model)["applied"] == {}


def test_same_spec_twice_is_a_no_op():
    model = tiny_model("llama")
    hfpatch.patch(model, position="yarn", factor=4)
    inv_freq = model.model.rotary_emb.inv_freq
    state = hfpatch.apply.state_of(model)
    hfpatch.patch(model, position="yarn", factor=4.0)
    assert model.model.rotary_emb.inv_freq is inv_freq  # nothing recomputed
    assert hfpatch.apply.state_of(model) is state
    assert sum(len(e) for e in state.layers.values()) > 0


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt_neox", "phi3"])
def test_second_patch_replaces_the_first(family):
    """yarn x4 then linear x2 is linear x2 on the original model, not both stacked."""
    model = tiny_model(family)
    fresh = tiny_model(family)
    x = tokens(160)
    hfpatch.patch(model, position="yarn", factor=4)
    hfpatch.patch(model, position="linear", factor=2)
    hfpatch.patch(fresh, position="linear", factor=2)
    assert max_diff(logits(model, x), logits(fresh, x)) == 0.0
    assert hfpatch.describe(model)["applied"] == {"position": {"scheme": "linear", "factor": 2.0}}
    assert model.config.max_position_embeddings == 2 * WINDOW
    hfpatch.unpatch(model)
    assert max_diff(logits(model, x), logits(tiny_model(family), x)) == 0.0


def test_patch_returns_the_same_object_and_describe_reports():
    model = tiny_model("llama")
    assert hfpatch.patch(model, position="yarn", factor=2) is model
    info = hfpatch.describe(model)
    assert info["family"] == "llama" and info["norm"]["kind"] == "rmsnorm" and info["placement"] == "pre"
    assert info["position"]["scheme"] == "yarn" and info["position"]["factor"] == 2.0
    assert info["position"]["rope_parameters"]["rope_type"] == "yarn"
    assert info["position"]["native"] is True
    assert info["max_position_embeddings"] == 2 * WINDOW
    assert "yarn" in info["patches"]["position"]


def test_describe_unpatched_models():
    assert hfpatch.describe(tiny_model("gpt2"))["position"]["scheme"] == "learned"
    assert hfpatch.describe(tiny_model("bert"))["placement"] == "post"
    assert hfpatch.describe(tiny_model("gemma"))["norm"] == {"kind": "rmsnorm", "scale": "1 + weight",
                                                            "bf16": "computed in float32, rounded once"}
    assert hfpatch.describe(tiny_model("gpt2"))["norm"]["kind"] == "layernorm"
    assert hfpatch.describe(tiny_model("llama"))["position"]["scheme"] == "rope"
    scaled = tiny_model("llama", rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4,
                                                 "original_max_position_embeddings": WINDOW})
    assert hfpatch.describe(scaled)["position"]["scheme"] == "yarn"


def test_supported_lists_every_family():
    info = hfpatch.supported(model_types=FAMILIES, use_cache=False)
    assert sorted(info) == sorted(FAMILIES)
    for family in ROPE_FAMILIES:
        assert {"yarn", "ntk", "dynamic-yarn", "rope"} <= set(info[family]["patches"]["position"])
    for family in ("gpt2", "opt", "bert"):
        assert info[family]["position"] == "learned"
        assert "yarn" not in info[family]["patches"]["position"]


def test_a_natively_scaled_model_can_go_back_to_plain_rope():
    """'rope' removes scaling the checkpoint came with (original window = its original_max_position_embeddings)."""
    rp = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4, "original_max_position_embeddings": WINDOW}
    model = tiny_model("llama", rope_parameters=rp, max_position_embeddings=2 * WINDOW)
    hfpatch.patch(model, position="rope")
    x = tokens(100)
    plain = native_model("llama", model, {"rope_type": "default", "rope_theta": 1e4}, WINDOW)
    assert max_diff(logits(model, x), logits(plain, x)) == 0.0
    assert model.config.max_position_embeddings == WINDOW


# ----------------------------------------------------------------------------------------------------------- errors

BAD = [
    (dict(position="yarn", factor=1.0), ValueError, "factor must be > 1"),
    (dict(position="yarn", factor=0.5), ValueError, "factor must be > 1"),
    (dict(position="linear", factor=-2), ValueError, "factor must be > 1"),
    (dict(position="yarn", factor=math.nan), ValueError, "factor must be finite"),
    (dict(position="ntk", factor=math.inf), ValueError, "factor must be finite"),
    (dict(position="yarn", factor="4"), TypeError, "factor must be a number"),
    (dict(position="yarn"), ValueError, "needs factor="),
    (dict(position="yran", factor=2), ValueError,
     "valid: rope, linear, ntk, dynamic, yarn, dynamic-yarn, llama3, longrope, p-rope, alibi, nope, sinusoidal, "
     "interpolate"),
    (dict(factor=2.0), ValueError, "without position="),
    (dict(position="yarn", factor=2, bogus=1), ValueError, "does not take bogus"),
    (dict(position="linear", factor=2, beta_fast=3), ValueError, "does not take beta_fast"),
    (dict(position="yarn", factor=2, beta_fast=1, beta_slow=4), ValueError, "beta_fast must be greater"),
    (dict(position="longrope", factor=4), ValueError, "needs short_factor and long_factor"),
    (dict(position="longrope", factor=4, short_factor=[1.0] * 8), ValueError, "needs long_factor"),
    (dict(position="longrope", factor=4, short_factor=[1.0] * 3, long_factor=[2.0] * 8), ValueError,
     "one entry per rotary frequency: 8"),
    (dict(position="longrope", factor=4, short_factor=[1.0] * 8, long_factor=[2.0] * 9), ValueError,
     "one entry per rotary frequency: 8"),
    (dict(position="yarn", factor=2, layer_types=["full_attention"]), ValueError, "per-layer-type RoPE"),
    (dict(position="yarn", factor=2, original_max_position_embeddings=0), ValueError, "positive integer"),
    (dict(position=3), TypeError, "position must be a string"),
    (dict(position="alibi", factor=2), ValueError, "position='alibi' does not take factor"),
    (dict(position="alibi", alibi_max_bias=-1), ValueError, "alibi_max_bias must be > 0"),
    (dict(position="interpolate", factor=2), ValueError, "stretches a learned absolute position table"),
    (dict(position="interpolate"), ValueError, "needs factor="),
    (dict(norm="groupnorm"), ValueError, "norm must be one of 'rmsnorm', 'layernorm', 'batchnorm'"),
    (dict(position="t5", num_buckets=2), ValueError, "num_buckets must be at least 4"),
    (dict(position="learned", table_size=-3), ValueError, "table_size must be a positive integer"),
    (dict(placement="sandwich"), ValueError, "placement must be one of 'pre', 'post'"),
    (dict(norm="rmsnorm", exact="yes"), ValueError, "exact must be True or False"),
    (dict(exact=False), ValueError, "exact= only applies together with norm="),
]


@pytest.mark.parametrize("kwargs,exc,message", BAD, ids=[str(b[0]) for b in BAD])
@pytest.mark.parametrize("already", [False, True], ids=["fresh", "patched"])
def test_bad_input_leaves_the_model_as_it_was(kwargs, exc, message, already):
    model = tiny_model("llama")  # head_dim 16: 8 rotary frequencies
    if already:
        hfpatch.patch(model, position="ntk", factor=3)
    x = tokens(100)
    before, fp, info = logits(model, x), fingerprint(model), hfpatch.describe(model)
    with pytest.raises(exc, match=message.replace("(", r"\(").replace("[", r"\[")):
        hfpatch.patch(model, **kwargs)
    assert_same_fingerprint(fingerprint(model), fp)
    assert max_diff(logits(model, x), before) == 0.0
    assert hfpatch.describe(model) == info


@pytest.mark.parametrize("family", ["gpt2", "opt", "bert"])
def test_rope_scheme_on_a_model_without_rope(family):
    model = tiny_model(family)
    fp = fingerprint(model)
    with pytest.raises(ValueError, match=f"RoPE scheme, but {family} has learned absolute position"):
        hfpatch.patch(model, position="yarn", factor=2)
    assert_same_fingerprint(fingerprint(model), fp)


def test_gemma3_unknown_layer_type():
    model = tiny_model("gemma3_text")
    fp = fingerprint(model)
    with pytest.raises(ValueError, match="unknown layer_types"):
        hfpatch.patch(model, position="yarn", factor=2, layer_types=["global"])
    assert_same_fingerprint(fingerprint(model), fp)


def test_a_scheme_that_does_not_fit_the_family_says_why():
    """Families without an adapter file are read off the model; what does not apply is refused with the reason
    (GPT-J rotates inside its attention, from a sin/cos table hfpatch cannot rebuild)."""
    cfg = AutoConfig.for_model("gptj", vocab_size=50, n_embd=32, n_layer=1, n_head=4, rotary_dim=4, n_positions=64,
                               bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="RoPE scheme, but gptj has a position encoding hfpatch cannot find"):
        hfpatch.patch(model, position="yarn", factor=2)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        hfpatch.patch(torch.nn.Linear(2, 2), position="yarn", factor=2)


@pytest.mark.parametrize("already", [False, True], ids=["fresh", "patched"])
def test_failure_half_way_is_rolled_back(monkeypatch, already):
    """A failure after some edits were made (here: after the rotary module was rebuilt) undoes them all."""
    model = tiny_model("gemma3_text")
    if already:
        hfpatch.patch(model, position="linear", factor=3)
    fp = fingerprint(model)
    record = schemes.SCHEMES["dynamic-yarn"]

    def boom(*args, **kwargs):
        record.per_forward(*args, **kwargs)
        raise RuntimeError("injected failure")

    # a registry takes each name once: the test swaps the record in its table for its own run only
    monkeypatch.setitem(schemes.SCHEMES._records, "dynamic-yarn", dataclasses.replace(record, per_forward=boom))
    with pytest.raises(PatchRefused, match=r"gemma3_text model \(RuntimeError: injected failure\)"):
        hfpatch.patch(model, position="dynamic-yarn")
    assert_same_fingerprint(fingerprint(model), fp)


def test_peft_model_is_patched_through_its_base_model():
    peft = pytest.importorskip("peft")
    x = tokens(120)
    model = tiny_model("llama")
    reference = hfpatch.patch(tiny_model("llama"), position="yarn", factor=2)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=True))
    assert hfpatch.patch(lora, position="yarn", factor=2) is lora
    assert hfpatch.describe(lora)["applied"]["position"]["scheme"] == "yarn"
    with torch.no_grad():
        assert max_diff(lora(x).logits, reference(x).logits) <= 1e-6
    hfpatch.unpatch(lora)
    assert hfpatch.describe(lora)["applied"] == {}


def test_unpatch_after_the_model_moved_dtype():
    """Buffers come back in the dtype (and device) the model has now, not the one it had when patched."""
    model = tiny_model("llama")
    x = tokens(100)
    hfpatch.patch(model, position="yarn", factor=4)
    model.double()
    hfpatch.unpatch(model)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float64
    reference = tiny_model("llama").double()
    assert max_diff(logits(model, x), logits(reference, x)) == 0.0


def test_spec_string_form():
    from hfpatch import spec

    assert spec.parse("yarn:4") == {"position": "yarn", "factor": 4.0}
    assert spec.parse("none") == {} and spec.parse("dynamic") == {"position": "dynamic"}
    assert spec.parse("yarn:4:beta_fast=16") == {"position": "yarn", "factor": 4.0, "beta_fast": 16}
    assert spec.parse("longrope:2:short_factor=[1,2]") == {"position": "longrope", "factor": 2.0,
                                                           "short_factor": [1, 2]}
    with pytest.raises(ValueError, match="factor 'x' is not a number"):
        spec.parse("yarn:x")
    model = tiny_model("llama")
    hfpatch.patch(model, **spec.parse("ntk:2"))
    assert spec.describe_string(hfpatch.describe(model)["applied"]) == "ntk:2"
