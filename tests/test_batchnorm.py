"""norm="batchnorm": torch.nn.BatchNorm1d over the real tokens (reference), padding ignored, running statistics in
eval(), errors."""

import pytest
import torch
from conftest import assert_same_fingerprint, fingerprint, logits, max_diff, tiny_model, tokens
from torch import nn

import hfpatch
from hfpatch.norm.batchnorm import PaddingMask, batch_statistics
from hfpatch.norm.modules import BatchNorm

C = 16


def pair(seed=0, eps=1e-5):
    """Our BatchNorm and torch's, with the same random affine parameters."""
    g = torch.Generator().manual_seed(seed)
    w, b = 1 + 0.3 * torch.randn(C, generator=g), 0.3 * torch.randn(C, generator=g)
    ours = BatchNorm(C, eps, bias=True)
    ref = nn.BatchNorm1d(C, eps=eps, momentum=0.1)
    with torch.no_grad():
        for m in (ours, ref):
            m.weight.copy_(w)
            m.bias.copy_(b)
    return ours, ref


def test_equals_batchnorm1d_on_unpadded_input():
    """[batch, seq, C] against BatchNorm1d on [batch, C, seq]: outputs in training, the running statistics after
    several steps, outputs in eval()."""
    ours, ref = pair()
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = 2.0 * torch.randn(3, 7, C, generator=g) + step
        out = ours(x)
        want = ref(x.transpose(1, 2)).transpose(1, 2)
        assert max_diff(out, want) < 1e-5
    assert max_diff(ours.running_mean, ref.running_mean) < 1e-6
    assert max_diff(ours.running_var, ref.running_var) < 1e-5
    assert int(ours.num_batches_tracked) == int(ref.num_batches_tracked) == 3
    ours.eval(), ref.eval()
    x = torch.randn(2, 5, C, generator=g)
    assert max_diff(ours(x), ref(x.transpose(1, 2)).transpose(1, 2)) < 1e-5


def test_padding_is_ignored():
    """Padded positions hold huge values: the statistics (and the running ones) are those of the real tokens only,
    i.e. BatchNorm1d on the real tokens as one batch of rows."""
    ours, ref = pair()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 9, C, generator=g)
    keep = torch.ones(3, 9, dtype=torch.long)
    keep[0, :4] = 0  # left padding
    keep[2, -3:] = 0  # right padding
    x[keep == 0] = 1e4
    ours.padding = PaddingMask()
    ours.padding.record(keep)
    out = ours(x)
    want = ref(x[keep.bool()])
    assert max_diff(out[keep.bool()], want) < 1e-5
    assert max_diff(ours.running_mean, ref.running_mean) < 1e-6
    assert max_diff(ours.running_var, ref.running_var) < 1e-5
    assert torch.isfinite(out).all()


def test_mask_covering_cached_tokens_and_per_head_inputs():
    """With a KV cache the mask covers the cached tokens too: the current ones are its last columns. QK norms see
    [batch, seq, heads, head_dim]: the mask broadcasts over the heads."""
    padding = PaddingMask()
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]])
    padding.record(mask)
    assert padding.keep(torch.zeros(2, 2, C)).tolist() == [1, 1, 1, 0]
    keep = padding.keep(torch.zeros(2, 4, 3, C)).view(2, 4, 3)
    assert torch.equal(keep, mask.bool()[:, :, None].expand(2, 4, 3))


def test_model_ignores_padding_and_uses_running_statistics_in_eval():
    model = hfpatch.patch(tiny_model("llama"), norm="batchnorm").train()
    ids = tokens(12, batch=2)
    keep = torch.ones(2, 12, dtype=torch.long)
    keep[1, -5:] = 0
    other = ids.clone()
    other[1, -5:] = 7  # different tokens in the padded slots
    with torch.no_grad():
        a = model(ids, attention_mask=keep).logits
        b = model(other, attention_mask=keep).logits
    assert max_diff(a[keep.bool()], b[keep.bool()]) < 1e-5
    # without the mask the padded tokens enter the statistics
    with torch.no_grad():
        c = model(other).logits
    assert max_diff(a[0], c[0]) > 1e-3
    # eval(): the running statistics, so a sequence's logits do not depend on what else is in the batch
    model.eval()
    with torch.no_grad():
        alone = model(ids[:1]).logits
        batched = model(torch.cat([ids[:1], other[1:]]), attention_mask=torch.ones(2, 12, dtype=torch.long)).logits
    assert max_diff(alone[0], batched[0]) < 1e-5
    with batch_statistics(model), torch.no_grad():  # batch statistics in eval(), running ones untouched
        running = [m.running_mean.clone() for m in model.modules() if isinstance(m, BatchNorm)]
        assert max_diff(model(ids[:1]).logits[0], alone[0]) > 1e-3
        assert all(torch.equal(r, m.running_mean) for r, m in
                   zip(running, [m for m in model.modules() if isinstance(m, BatchNorm)]))


def test_describe_says_never_exact_and_positional_mask_is_read():
    model = tiny_model("gpt2")
    hfpatch.norm.convert._WARNED.clear()  # the warning is given once per reason
    with pytest.warns(UserWarning, match="batchnorm.*never function-preserving"):
        hfpatch.patch(model, norm="batchnorm")
    info = hfpatch.describe(model)
    assert info["norm"]["kind"] == "batchnorm" and info["norm"]["exact"] is False
    assert "never" in info["norm"]["reason"]
    ids = tokens(6, batch=2)
    keep = torch.ones(2, 6, dtype=torch.long)
    keep[0, :2] = 0
    with batch_statistics(model), torch.no_grad():  # eval(): no dropout; the statistics of the batch
        by_keyword = model.transformer(input_ids=ids, attention_mask=keep).last_hidden_state
        by_position = model.transformer(ids, None, keep).last_hidden_state  # (input_ids, past_key_values, mask)
        unmasked = model.transformer(ids).last_hidden_state
    assert max_diff(by_keyword, by_position) == 0.0
    assert max_diff(by_keyword[1], unmasked[1]) > 1e-3


def test_errors_leave_a_clear_message():
    model = hfpatch.patch(tiny_model("llama"), norm="batchnorm").train()
    ids = tokens(6, batch=1)
    with pytest.raises(ValueError, match="2D attention_mask"):
        model(ids, attention_mask=torch.ones(1, 1, 6, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="more than one real token"):
        model(ids[:, :1])
    model.eval()
    model(ids[:, :1])  # eval() uses the running statistics: one token is fine
    fresh = tiny_model("llama")
    before = fingerprint(fresh)
    with pytest.raises(ValueError, match="norm must be one of"):
        hfpatch.patch(fresh, norm="groupnorm")
    assert_same_fingerprint(fingerprint(fresh), before)


def test_unpatch_restores_the_model_and_the_mixin_goes():
    model = tiny_model("qwen3")
    x = tokens(20)
    ref, fp = logits(model, x), fingerprint(model)
    hfpatch.patch(model, norm="batchnorm")
    assert "RecordsPadding" in type(model.model).__name__
    hfpatch.unpatch(model)
    assert max_diff(logits(model, x), ref) == 0.0
    assert_same_fingerprint(fingerprint(model), fp)
