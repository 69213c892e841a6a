"""norm="batchnorm" on a pretrained model: fresh running statistics (mean 0, variance 1) normalise nothing, so the
model's logits in eval() can be non-finite. The swap says so when it happens (a warning naming hfpatch.calibrate),
and hfpatch.calibrate sets the running statistics from given batches, or from a probe batch: the exact average of the
statistics each norm sees, as in training."""

from __future__ import annotations

import warnings

import pytest
import torch

import hfpatch
from hfpatch import tiny
from hfpatch.norm.modules import BatchNorm


def _amplifying():
    """A tiny Llama whose MLPs write 1e18 times too much into the residual stream: harmless with its RMSNorms (they
    rescale every token), overflowing once they are BatchNorms that divide by a variance of 1."""
    model = tiny.build_tiny("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(1e18)
    return model


@torch.no_grad()
def _finite(model, ids) -> bool:
    return bool(torch.isfinite(model.eval()(input_ids=ids).logits).all())


def _patch(model) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hfpatch.patch(model, norm="batchnorm")
    return [str(w.message) for w in caught]


def test_a_swap_whose_fresh_statistics_give_non_finite_logits_warns_and_calibration_fixes_it():
    model, ids = _amplifying(), tiny.sample_ids(2, 32)
    assert _finite(model, ids)
    said = [m for m in _patch(model) if "fresh running statistics" in m]
    assert len(said) == 1 and "hfpatch.calibrate" in said[0]
    assert not _finite(model, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # calibrated: no warning that it is still not finite
        assert hfpatch.calibrate(model, ids) == 5  # 2 layers x 2 norms + the final norm
    assert _finite(model, ids) and _finite(model, tiny.sample_ids(2, 32, seed=7))


def test_a_swap_with_finite_logits_gives_no_such_warning():
    assert not [m for m in _patch(tiny.build_tiny("llama")) if "fresh running statistics" in m]


@torch.no_grad()
def test_calibrated_statistics_are_the_average_of_the_batch_statistics_each_norm_sees():
    model = tiny.build_tiny("llama")
    _patch(model)
    batches = [tiny.sample_ids(2, 16, seed=s) for s in (1, 2, 3)]
    first = model.model.layers[0].input_layernorm  # its input is the embeddings: known without running the model
    hfpatch.calibrate(model, batches)
    rows = [model.model.embed_tokens(b).reshape(-1, first.running_mean.numel()).double() for b in batches]
    mean = torch.stack([r.mean(0) for r in rows]).mean(0)
    var = torch.stack([r.var(0, unbiased=True) for r in rows]).mean(0)
    torch.testing.assert_close(first.running_mean.double(), mean, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(first.running_var.double(), var, rtol=1e-5, atol=1e-7)
    assert all(not m.training for m in model.modules())  # modes and momentum restored
    assert all(m.momentum == 0.1 for m in model.modules() if isinstance(m, BatchNorm))


def test_calibrating_from_a_probe_batch_and_from_a_tokenizer_output():
    model = tiny.build_tiny("llama")
    _patch(model)
    assert hfpatch.calibrate(model) == 5
    norm = model.model.layers[1].input_layernorm
    assert not torch.equal(norm.running_var, torch.ones_like(norm.running_var))
    ids = tiny.sample_ids(2, 16)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding: not counted
    assert hfpatch.calibrate(model, {"input_ids": ids, "attention_mask": mask}) == 5


@pytest.mark.parametrize(("batches", "error", "message"), [
    ("some text", TypeError, "calibrate: batches must be token ids"),
    (torch.tensor([1, 2, 3]), ValueError, r"calibrate: each batch needs input_ids of shape \[batch, seq\]"),
    ([], ValueError, "calibrate: no batches given"),
])
def test_calibrate_refuses_what_is_not_a_batch(batches, error, message):
    model = tiny.build_tiny("llama")
    _patch(model)
    with pytest.raises(error, match=message):
        hfpatch.calibrate(model, batches)


def test_calibrate_needs_batchnorms():
    with pytest.raises(ValueError, match="calibrate: the model has no BatchNorm"):
        hfpatch.calibrate(tiny.build_tiny("llama"))


@pytest.mark.parametrize(("norm", "batches", "error", "message"), [
    ("batchnorm", torch.tensor([[1, 2, 10**6]]), ValueError, r"1 id\(s\) outside the vocabulary \(1000000 at "),
    ("dyt", torch.tensor([[1, -3, 4, -5]]), ValueError, r"2 id\(s\) outside the vocabulary \(-3 at \(0, 1\), -5 at "),
    ("dyt", {"input_ids": torch.tensor([[0, 1, 2]]) + tiny.VOCAB}, ValueError, r"\(128 at \(0, 0\), 129 at "),
    ("batchnorm", torch.tensor([[1.0, 2.0, 3.0]]), TypeError, "input_ids hold torch.float32 values"),
    ("dyt", [torch.tensor([[1, 2]]), torch.tensor([[1, 2]], dtype=torch.int16)], TypeError, "torch.int16 values"),
])
def test_calibrate_refuses_token_ids_the_model_cannot_embed(norm, batches, error, message):
    """Ids outside [0, vocab_size), negative ones, and ids that are not integers: one error naming them and what is
    accepted (not the embedding's IndexError, or a RuntimeError about its indices), and the model unchanged."""
    model = tiny.build_tiny("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hfpatch.patch(model, norm=norm)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=message) as refused:
        hfpatch.calibrate(model, batches)
    assert f"integer token ids (torch.long or torch.int) in [0, {tiny.VOCAB})" in str(refused.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
