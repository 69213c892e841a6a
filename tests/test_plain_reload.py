"""A checkpoint saved with a patch that plain transformers cannot express says so twice: when saved (a warning naming
hfpatch.from_pretrained) and when reloaded without hfpatch (config.json names hfpatch as its quantization method, so
transformers warns with that sentence instead of loading the original architecture silently). hfpatch.from_pretrained
reloads the patched model as it was. Self-Extend's options are bounded, and its checkpoint's config.json keeps the
trained window for a plain reload."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from conftest import plain_reload_log
from transformers import AutoModelForCausalLM

import hfpatch
from hfpatch import tiny

NON_NATIVE = [("gpt2", dict(norm="rmsnorm")), ("llama", dict(norm="layernorm")), ("llama", dict(placement="post")),
              ("llama", dict(position="alibi")), ("llama", dict(position="self-extend", group_size=4, window=8))]


def _patched(model_type, kwargs):
    model = tiny.build_tiny(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # plain-swap warnings
        hfpatch.patch(model, **kwargs)
    return model.eval()


def _save(model, path) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hfpatch.save_pretrained(model, path)
    return [str(w.message) for w in caught]


@torch.no_grad()
def _logits(model, ids):
    return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize(("model_type", "kwargs"), NON_NATIVE, ids=lambda c: c if isinstance(c, str) else
                         "+".join(f"{k}={v}" for k, v in c.items()))
def test_a_save_plain_transformers_cannot_express_says_so_and_a_plain_reload_warns(tmp_path, model_type, kwargs):
    model = _patched(model_type, kwargs)
    axis = next(iter(kwargs))
    said = [m for m in _save(model, tmp_path) if "hfpatch.from_pretrained reloads the patch" in m]
    assert len(said) == 1 and said[0].startswith(f"{axis}=")
    log = plain_reload_log(tmp_path)
    assert "hfpatch.from_pretrained" in log and "unpatched architecture" in log
    loaded = hfpatch.from_pretrained(tmp_path).eval()
    assert getattr(loaded.config, "quantization_config", None) is None
    assert hfpatch.describe(loaded)["applied"] == hfpatch.describe(model)["applied"]
    ids = tiny.sample_ids(1, 24)
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))
    # the model saved keeps its own config: the mark was there for the save only
    assert getattr(model.config, "quantization_config", None) is None


def test_a_native_save_carries_no_mark_and_no_warning(tmp_path):
    model = _patched("llama", dict(position="yarn", factor=2.0))
    assert not [m for m in _save(model, tmp_path) if "hfpatch" in m]
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    assert "hfpatch" not in plain_reload_log(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = tiny.sample_ids(1, 24)
    assert torch.equal(_logits(plain, ids), _logits(model, ids))


def test_a_self_extend_checkpoint_keeps_the_trained_window_for_a_plain_reload(tmp_path):
    model = _patched("llama", dict(position="self-extend", group_size=4, window=8))
    extended = (tiny.WINDOW - 8) * 4 + 8  # (L - W) * G + W
    assert model.config.max_position_embeddings == extended
    _save(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["max_position_embeddings"] == tiny.WINDOW
    assert model.config.max_position_embeddings == extended  # the model saved is unchanged
    assert hfpatch.from_pretrained(tmp_path).config.max_position_embeddings == extended


@pytest.mark.parametrize(("options", "message"), [
    (dict(group_size=10 ** 18, window=8), "group_size must be at most 65536 (it extends the window about G times, "
                                          "like factor), got 1000000000000000000"),
    (dict(group_size=1e18, window=8), "group_size must be a positive integer, got 1e+18"),
    (dict(group_size=65537, window=8), "group_size must be at most 65536"),
    (dict(group_size=4, window=10 ** 18), "window=1000000000000000000 is beyond the 64 tokens"),
])
def test_self_extend_options_past_their_range_are_refused(options, message):
    model = tiny.build_tiny("llama")
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        hfpatch.patch(model, position="self-extend", **options)
    assert hfpatch.describe(model)["applied"] == {}
    assert model.config.max_position_embeddings == tiny.WINDOW


def test_describe_says_what_the_model_was_loaded_with_and_unpatch_gives_the_base(tmp_path):
    """A folder saved with yarn:4 reloads with yarn:4 applied again; describe() names it, and unpatch goes back to
    the checkpoint's base model (the loaded patch undone too), which describe() says beforehand."""
    base = tiny.build_tiny("llama")
    hfpatch.save_pretrained(hfpatch.patch(tiny.build_tiny("llama"), position="yarn", factor=4), tmp_path / "y")
    model = hfpatch.from_pretrained(tmp_path / "y")
    info = hfpatch.describe(model)
    assert info["loaded_with"] == "yarn:4" and info["unpatch_restores"] == "the checkpoint's base model"
    assert hfpatch.describe(base)["loaded_with"] is None
    hfpatch.unpatch(model)
    after = hfpatch.describe(model)
    assert after["applied"] == {} and after["loaded_with"] == "yarn:4"  # where it came from, still
    assert after["position"]["rope_parameters"] == hfpatch.describe(base)["position"]["rope_parameters"]
