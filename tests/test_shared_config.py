"""Two models built from one config object (`from_config(a.config)` shares it): patching one must not change the
other, and patching and unpatching both leaves the shared config as it was."""

from __future__ import annotations

import copy
import tempfile

import torch
from transformers import AutoModelForCausalLM

import hfpatch
from hfpatch import tiny


@torch.no_grad()
def _logits(model, ids):
    return model(input_ids=ids, use_cache=False).logits


def _twins():
    a = tiny.build_tiny("llama")
    b = AutoModelForCausalLM.from_config(a.config).eval()
    b.load_state_dict(a.state_dict())
    assert b.config is a.config  # what transformers does: the premise of these tests
    return a, b


def test_patching_one_model_leaves_its_twin_and_their_shared_config_alone():
    a, b = _twins()
    shared = a.config
    original = copy.deepcopy(shared.to_dict())
    ids = tiny.sample_ids(1, 80)
    b_before = _logits(b, ids)
    hfpatch.patch(a, position="yarn", factor=4.0)
    assert hfpatch.describe(a)["position"]["scheme"] == "yarn"
    assert hfpatch.describe(b)["position"]["scheme"] == "rope"
    assert b.config.max_position_embeddings == tiny.WINDOW
    assert shared.to_dict() == original
    assert torch.equal(_logits(b, ids), b_before)
    with tempfile.TemporaryDirectory() as tmp:
        hfpatch.save_pretrained(b, tmp)
        reloaded = hfpatch.from_pretrained(tmp).eval()
    assert torch.equal(_logits(reloaded, ids), b_before)


def test_patching_and_unpatching_both_twins_restores_the_shared_config():
    a, b = _twins()
    original = copy.deepcopy(a.config.to_dict())
    hfpatch.patch(a, position="yarn", factor=4.0)
    hfpatch.patch(b, position="ntk", factor=2.0)
    assert hfpatch.describe(a)["applied"]["position"]["scheme"] == "yarn"
    assert hfpatch.describe(b)["applied"]["position"]["scheme"] == "ntk"
    hfpatch.unpatch(a)
    hfpatch.unpatch(b)
    assert a.config is b.config  # the original object comes back to both
    assert a.config.to_dict() == original
