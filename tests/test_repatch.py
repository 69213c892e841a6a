"""Patching a model that was trained, copied, cast or saved after an earlier patch: later patches keep what they do
not replace, failures put back the very objects that were there, copies and casts unpatch cleanly, and saved chains
of weight-changing patches reload."""

import copy
import warnings

import pytest
import torch
from conftest import assert_same_fingerprint, fingerprint, logits, max_diff, tiny_model, tokens

import hfpatch
import hfpatch.spec
from hfpatch.apply import PatchRefused


def _train(model, seed=0):
    """Stand-in for an optimizer step: every parameter moves in place (as AdamW moves it)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _params(model):
    return {n: p for n, p in model.named_parameters()}


def _shared_configs(fp):
    """A fingerprint with config objects named by which modules share them rather than by id (two models)."""
    *rest, ids = fp
    seen = {}
    return (*rest, {name: seen.setdefault(i, len(seen)) for name, i in ids.items()})


@pytest.mark.parametrize("family, first, second", [
    ("gpt2", dict(norm="rmsnorm"), dict(position="alibi")),
    ("llama", dict(norm="layernorm"), dict(position="yarn", factor=2.0)),
    ("llama", dict(placement="post"), dict(position="ntk", factor=2.0)),
    ("opt", dict(norm="rmsnorm", placement=None), dict(position="nope")),
])
def test_later_axis_keeps_trained_weights_of_earlier_axes(family, first, second):
    model = tiny_model(family)
    hfpatch.patch(model, **first)
    _train(model)
    before = {n: (p, p.detach().clone()) for n, p in _params(model).items()}
    hfpatch.patch(model, **second)
    after = _params(model)
    assert after.keys() == before.keys()
    for n, (p, value) in before.items():
        assert after[n] is p, f"{n} was replaced: an optimizer built before the second patch would lose it"
        assert torch.equal(after[n], value), n
    # and the result is the same as patching a fresh model with both in one call, then giving it the trained
    # weights: every tensor, module class, attribute and config value, and the logits
    scratch = hfpatch.patch(tiny_model(family), **{**first, **second})
    scratch.load_state_dict(model.state_dict())
    assert hfpatch.describe(model) == hfpatch.describe(scratch)
    assert_same_fingerprint(_shared_configs(fingerprint(model)), _shared_configs(fingerprint(scratch)))
    x = tokens(80)  # past the tiny models' window of 64, where the position patch acts
    assert max_diff(logits(model, x), logits(scratch, x)) == 0.0


@pytest.mark.parametrize("family, first, bad", [
    ("gpt2", dict(norm="rmsnorm"), dict(position="yarn", factor=2.0)),        # RoPE scheme on a model without RoPE
    ("gpt2", dict(position="interpolate", factor=2.0), dict(norm="rmsnorm", placement="sideways")),
    ("llama", dict(norm="layernorm", position="yarn", factor=2.0), dict(position="longrope", factor=4.0,
                                                                         short_factor=[1.0], long_factor=[1.0])),
])
def test_failed_patch_after_training_leaves_the_trained_model_exactly(family, first, bad):
    model = tiny_model(family)
    hfpatch.patch(model, **first)
    _train(model)
    x = tokens(40)
    ref, fp, params = logits(model, x), fingerprint(model), _params(model)
    described = hfpatch.describe(model)
    with pytest.raises((ValueError, TypeError)):
        hfpatch.patch(model, **bad)
    assert max_diff(logits(model, x), ref) == 0.0
    assert_same_fingerprint(fingerprint(model), fp)
    assert all(p is params[n] for n, p in _params(model).items())
    assert hfpatch.describe(model) == described


def test_failure_while_applying_puts_back_the_previous_objects(monkeypatch):
    """A failure inside the application (not caught by validation) also restores the previous patch's objects."""
    import dataclasses

    from hfpatch.position.registry import SCHEMES

    model = tiny_model("gpt2")
    hfpatch.patch(model, norm="rmsnorm", position="interpolate", factor=2.0)
    _train(model)
    x = tokens(40)
    ref, params = logits(model, x), _params(model)
    real = SCHEMES["interpolate"].apply

    def half_then_fail(*args, **kwargs):
        real(*args, **kwargs)
        raise RuntimeError("disk full")

    failing = dataclasses.replace(SCHEMES["interpolate"], apply=half_then_fail)
    monkeypatch.setitem(SCHEMES._records, "interpolate", failing)
    with pytest.raises(PatchRefused, match=r"gpt2 model \(RuntimeError: disk full\)"):
        hfpatch.patch(model, position="interpolate", factor=3.0)
    assert max_diff(logits(model, x), ref) == 0.0
    assert all(p is params[n] for n, p in _params(model).items())


def test_redoing_a_weight_changing_axis_warns():
    model = tiny_model("gpt2")
    hfpatch.patch(model, position="interpolate", factor=2.0)
    with pytest.warns(UserWarning, match="interpolate.*applied again"):
        hfpatch.patch(model, norm="rmsnorm")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hfpatch.patch(model, position="alibi")  # replacing it is what was asked: no warning


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family, kwargs", [
    ("llama", dict(norm="layernorm")),
    ("gpt2", dict(norm="rmsnorm")),
    ("opt", dict(norm="rmsnorm", position="interpolate", factor=2.0)),
    ("gemma2", dict(norm="layernorm", position="alibi")),
])
def test_unpatch_after_a_cast_gives_the_cast_original(family, kwargs, dtype):
    model, fresh = tiny_model(family), tiny_model(family)
    hfpatch.patch(model, **kwargs)
    model.to(dtype)
    hfpatch.unpatch(model)
    fresh.to(dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}
    x = tokens(40)
    assert max_diff(logits(model, x), logits(fresh, x)) == 0.0


@pytest.mark.parametrize("family, kwargs", [
    ("llama", dict(position="yarn", factor=2.0, placement="post")),
    ("gpt2", dict(norm="rmsnorm", position="alibi")),
    ("bert", dict(norm="rmsnorm", position="sinusoidal")),
])
def test_deepcopy_of_a_patched_model_unpatches_on_its_own(tmp_path, family, kwargs):
    model, fresh = tiny_model(family), tiny_model(family)
    hfpatch.patch(model, **kwargs)
    x = tokens(40)
    patched = logits(model, x)
    twin = copy.deepcopy(model)
    assert max_diff(logits(twin, x), patched) == 0.0
    hfpatch.unpatch(twin)
    assert max_diff(logits(twin, x), logits(fresh, x)) == 0.0
    a, b = fingerprint(twin), fingerprint(fresh)
    assert_same_fingerprint((*a[:4], None), (*b[:4], None))  # config objects: the copy has its own
    assert max_diff(logits(model, x), patched) == 0.0  # the original is still patched
    twin.save_pretrained(tmp_path)  # nothing unserializable left behind in the config


@pytest.mark.parametrize("family, first, second", [
    ("gpt2", dict(norm="rmsnorm"), dict(norm="layernorm")),
    ("gpt2", dict(position="interpolate", factor=2.0), dict(position="interpolate", factor=1.5)),
    ("gpt2", dict(position="interpolate", factor=2.0), dict(position="alibi")),
    ("llama", dict(norm="layernorm", placement="post"), dict(norm="rmsnorm", position="yarn", factor=2.0)),
])
def test_reloaded_model_patched_again_saves_and_reloads(tmp_path, family, first, second):
    model = tiny_model(family)
    hfpatch.patch(model, **first)
    hfpatch.save_pretrained(model, tmp_path / "a")
    again = hfpatch.from_pretrained(tmp_path / "a").eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # inexact swaps warn
        hfpatch.patch(again, **second)
    x = tokens(40)
    ref = logits(again, x)
    hfpatch.save_pretrained(again, tmp_path / "b")
    third = hfpatch.from_pretrained(tmp_path / "b").eval()
    assert max_diff(logits(third, x), ref) == 0.0
    assert hfpatch.describe(third)["applied"] == hfpatch.describe(again)["applied"]
    assert third.config.max_position_embeddings == again.config.max_position_embeddings


def test_saving_a_model_with_peft_adapters_asks_to_merge(tmp_path):
    peft = pytest.importorskip("peft")
    model = tiny_model("llama")
    hfpatch.patch(model, position="yarn", factor=2.0)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"peft adapters.*merge_and_unload"):
        hfpatch.save_pretrained(lora, tmp_path)
    merged = lora.merge_and_unload()
    hfpatch.save_pretrained(merged, tmp_path)
    x = tokens(40)
    assert max_diff(logits(hfpatch.from_pretrained(tmp_path), x), logits(merged, x)) == 0.0


def test_exact_conversion_on_lora_layers_says_what_to_do():
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(tiny_model("gpt2"), peft.LoraConfig(r=2, target_modules=["c_attn"],
                                                                  fan_in_fan_out=True))
    fp = fingerprint(lora.get_base_model())
    with pytest.raises(ValueError, match=r"wrapped by peft.*exact=False"):
        hfpatch.patch(lora, norm="rmsnorm")
    assert_same_fingerprint(fingerprint(lora.get_base_model()), fp)


@pytest.mark.parametrize("text, message", [
    ("yarn:4+yarn:2", "position.*given twice"),
    ("yarn:4:factor=2", "factor given twice"),
    ("placement=post+placement=pre", "placement given twice"),
])
def test_contradictory_spec_strings(text, message):
    with pytest.raises(ValueError, match=message):
        hfpatch.spec.parse(text)


def test_spec_string_as_position_points_to_the_string_form():
    with pytest.raises(ValueError, match=r"spec\.parse"):
        hfpatch.patch(tiny_model("llama"), position="yarn:4")


def test_unknown_keyword_lists_what_is_accepted():
    with pytest.raises(TypeError, match=r"unknown option.*foo.*accepts position="):
        hfpatch.patch(tiny_model("llama"), norm="rmsnorm", foo=1)
