"""describe() states each fact once: a norm swap's `exact` in describe()["applied"] is the same fact as in
describe()["norm"], whether the exact conversion was made or the math allowed only a plain swap."""

from __future__ import annotations

import json
import warnings

import pytest

import hfpatch
from hfpatch import spec, tiny


def _patched(model_type: str, **kwargs) -> dict:
    model = tiny.build_tiny(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the plain-swap warning
        hfpatch.patch(model, **kwargs)
    return hfpatch.describe(model)


@pytest.mark.parametrize(("model_type", "norm"), [("gemma3_text", "layernorm"), ("gemma3_text", "batchnorm"),
                                                  ("bert", "rmsnorm"), ("llama", "layernorm")])
def test_a_plain_swap_is_reported_inexact_in_applied_as_in_norm(model_type, norm):
    info = _patched(model_type, norm=norm)
    assert info["norm"]["exact"] is False and info["norm"]["reason"]
    assert info["applied"]["norm"] == {"kind": norm, "exact": False}
    assert spec.describe_string(info["applied"]) == f"norm={norm}:inexact"


def test_the_exact_conversion_is_reported_exact_in_both():
    info = _patched("gpt2", norm="rmsnorm")
    assert info["norm"]["exact"] is True
    assert info["applied"]["norm"] == {"kind": "rmsnorm", "exact": True}


def test_an_asked_for_plain_swap_is_inexact_in_both():
    info = _patched("gpt2", norm="rmsnorm", exact=False)
    assert info["norm"]["exact"] is False
    assert info["applied"]["norm"] == {"kind": "rmsnorm", "exact": False}


def test_the_saved_record_states_the_same_fact_and_reloads_it(tmp_path):
    model = tiny.build_tiny("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hfpatch.patch(model, norm="layernorm")
        hfpatch.save_pretrained(model, tmp_path)
        loaded = hfpatch.from_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["hfpatch"]
    assert saved["spec"]["norm"]["exact"] is False and saved["facts"]["norm"]["exact"] is False
    assert hfpatch.describe(loaded)["applied"] == hfpatch.describe(model)["applied"] == saved["spec"]
