"""Options past any sensible range are refused with the bound and what the option is, before the model is touched
(no OverflowError, "math domain error" or allocator error from deep inside); a position table the device has no room
for is refused before it is allocated; a patch made under torch.inference_mode() leaves a model that still trains."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import hfpatch
from hfpatch import tiny
from hfpatch.position.schemes import absolute


def _weights(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model, before: dict) -> None:
    assert hfpatch.describe(model)["applied"] == {}
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(position="yarn", factor=1e308), "factor must be at most 65536 (the context extension ratio), got 1e+308"),
    (dict(position="linear", factor=1e308), "factor must be at most 65536"),
    (dict(position="llama3", factor=1e308), "factor must be at most 65536"),
    (dict(position="dynamic-yarn", factor=1e308), "factor must be at most 65536"),
    (dict(position="dynamic", factor=1e308), "factor must be at most 65536"),
    (dict(position="ntk", factor=1e300), "factor must be at most 65536"),
    (dict(position="ntk", factor=10 ** 400), "factor must be finite"),
    (dict(position="yarn", factor=2.0, beta_fast=1e308), "beta_fast must be at most 1e+06 (a number of rotations"),
    (dict(position="yarn", factor=2.0, beta_slow=1e308), "beta_slow must be at most 1e+06"),
    (dict(position="yarn", factor=2.0, attention_factor=1e308), "attention_factor must be at most 100"),
    (dict(position="sinusoidal", pe_scale=1e308), "pe_scale must be at most 1000"),
    (dict(position="learned", init_std=1e308), "init_std must be at most 10"),
    (dict(position="t5", num_buckets=10 ** 12), "num_buckets must be at most 4096"),
    (dict(position="t5", max_distance=10 ** 18), "max_distance must be at most 1048576"),
])
def test_an_option_past_its_range_is_refused_with_the_bound(kwargs, message):
    model = tiny.build_tiny("llama")
    before = _weights(model)
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        hfpatch.patch(model, **kwargs)
    _unchanged(model, before)


def test_the_largest_accepted_factor_still_gives_finite_logits():
    model = tiny.build_tiny("llama")
    for scheme in ("yarn", "ntk", "linear", "llama3"):
        hfpatch.patch(model, position=scheme, factor=65536.0)
        with torch.no_grad():
            assert torch.isfinite(model(input_ids=tiny.sample_ids(1, 16)).logits).all(), scheme


def test_interpolating_past_the_free_memory_is_refused_before_allocating(monkeypatch):
    model = tiny.build_tiny("gpt2")
    before = _weights(model)
    rows = model.transformer.wpe.num_embeddings
    monkeypatch.setattr(absolute, "free_bytes", lambda device: 1 << 20)  # 1 MiB free
    with pytest.raises(ValueError, match=rf"position='interpolate' with factor=1000 makes a position table of "
                                         rf"{rows * 1000:,} rows x \d+, which needs .* GiB while cpu has 0.000977 GiB"):
        hfpatch.patch(model, position="interpolate", factor=1000.0)
    _unchanged(model, before)


def test_a_learned_table_past_the_free_memory_is_refused_before_allocating():
    model = tiny.build_tiny("llama")
    before = _weights(model)
    with pytest.raises(ValueError, match=r"position='learned' with table_size=1000000000000 makes a position table"):
        hfpatch.patch(model, position="learned", table_size=10 ** 12)
    _unchanged(model, before)


@pytest.mark.parametrize("kwargs", [dict(norm="layernorm"), dict(norm="batchnorm"), dict(position="t5"),
                                    dict(position="learned"), dict(position="xl")])
def test_a_patch_made_under_inference_mode_still_trains(kwargs):
    model = tiny.build_tiny("llama")
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the plain-swap warning
        hfpatch.patch(model, **kwargs)
    assert not any(t.is_inference() for t in model.parameters())
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        ids = tiny.sample_ids(2, 16)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    hfpatch.unpatch(model)


def test_a_model_built_under_inference_mode_is_patched_for_inference():
    with torch.inference_mode():
        model = tiny.build_tiny("llama")
        hfpatch.patch(model, position="t5")
        assert all(t.is_inference() for t in model.parameters())
        assert torch.isfinite(model(input_ids=tiny.sample_ids(1, 16)).logits).all()
