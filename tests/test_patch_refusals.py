"""Nothing escapes `patch` as an internal error: an exception raised while a patch is being applied (not a refusal of
the request) becomes a PatchRefused that names the family and the patch, and the model is exactly as it was."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import hfpatch
from hfpatch import tiny
from hfpatch.apply import PatchRefused
from hfpatch.position.registry import SCHEMES


@torch.no_grad()
def _logits(model, ids):
    return model(input_ids=ids, use_cache=False).logits


def _snapshot(model):
    return {"config": copy.deepcopy(model.config.to_dict()), "describe": hfpatch.describe(model),
            "classes": [type(m) for m in model.modules()]}


def test_odd_partial_rotation_is_refused_naming_the_family_and_the_model_is_unchanged():
    # mimo_v2_flash rotates partial_rotary_factor 0.334 of each head: with 16-channel heads that is 5 channels, and
    # transformers' YaRN ramp (dim // 2 entries) does not match the 3 frequencies. It used to escape as a RuntimeError.
    model = tiny._build("mimo_v2_flash", head_dim=16)
    ids = tiny.sample_ids(1, 24)
    before, snap = _logits(model, ids), _snapshot(model)
    with pytest.raises(PatchRefused, match=r"mimo_v2_flash.*unchanged") as info:
        hfpatch.patch(model, position="yarn", factor=4.0, original_max_position_embeddings=64)
    assert "yarn:4" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert torch.equal(_logits(model, ids), before)
    assert _snapshot(model) == snap


def _crash_after(scheme: str, error: BaseException):
    """The scheme's record with an applier that makes all its edits and then fails."""
    record = SCHEMES[scheme]

    def apply(model, adapter, req, rec, edits):
        record.apply(model, adapter, req, rec, edits)
        raise error

    return dataclasses.replace(record, apply=apply)


@pytest.mark.parametrize("error", [RuntimeError("boom"), IndexError("index 3 is out of bounds")])
def test_an_internal_error_in_a_repatch_is_a_refusal_and_the_previous_patch_stays(monkeypatch, error):
    model = tiny.build_tiny("llama")
    ids = tiny.sample_ids(1, 80)
    hfpatch.patch(model, position="yarn", factor=4.0)
    patched, snap = _logits(model, ids), _snapshot(model)
    monkeypatch.setitem(SCHEMES._records, "ntk", _crash_after("ntk", error))
    with pytest.raises(PatchRefused, match=r"'ntk:2' to this llama model \(" + type(error).__name__):
        hfpatch.patch(model, position="ntk", factor=2.0)
    assert torch.equal(_logits(model, ids), patched)
    assert _snapshot(model) == snap
    hfpatch.unpatch(model)
    assert hfpatch.describe(model)["applied"] == {}


def test_an_interrupt_is_not_turned_into_a_refusal(monkeypatch):
    model = tiny.build_tiny("llama")
    ids = tiny.sample_ids(1, 80)
    before = _logits(model, ids)
    monkeypatch.setitem(SCHEMES._records, "ntk", _crash_after("ntk", KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        hfpatch.patch(model, position="ntk", factor=2.0)
    assert torch.equal(_logits(model, ids), before)
    assert hfpatch.describe(model)["applied"] == {}
