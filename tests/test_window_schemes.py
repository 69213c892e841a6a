"""What position='self-extend' and position='dual-chunk' share, as schemes built on the model's trained window that
infer cached keys' positions: cached decoding equal to the full forward (where the family chooses the keys too),
gradients equal to the eager path's, the refusal of a model without a trained window, and of a static cache."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_refused, max_diff, tiny_model, tokens
from handref import cached_and_full, gradients_by_name

import hfpatch
from hfpatch import tiny

# each scheme with small settings: the tiny models' window is short
SCHEMES = {"self-extend": dict(position="self-extend", group_size=2, window=8),
           "dual-chunk": dict(position="dual-chunk", chunk_size=16, local_window=2)}
STATIC = {"self-extend": dict(position="self-extend", group_size=4, window=8),
          "dual-chunk": dict(position="dual-chunk", chunk_size=16, local_window=2)}
# Self-Extend rotates cached keys at both maps; Dual Chunk's chunk boundaries fall inside the cached part, the chunk
# of queries and between steps
CACHED = {"self-extend": dict(position="self-extend", group_size=3, window=10),
          "dual-chunk": dict(position="dual-chunk", chunk_size=16, local_window=3)}
GRADIENTS = {"self-extend": dict(position="self-extend", group_size=2, window=8),
             "dual-chunk": dict(position="dual-chunk", chunk_size=12, local_window=2)}


@pytest.mark.parametrize("scheme", CACHED)
@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3_text", "gpt_neox"])
def test_cached_decoding_equals_the_full_forward(family, scheme):
    """The cache holds un-rotated keys; each step rotates them. Padding on the left, as generate() pads: the
    positions count real tokens only."""
    model = hfpatch.patch(tiny_model(family), **CACHED[scheme])
    stepped, full, same = cached_and_full(model)
    assert max_diff(stepped, full) <= 1e-5
    assert same


@pytest.mark.parametrize("scheme", GRADIENTS)
def test_gradients_match_the_eager_path(scheme):
    """With gradients the sdpa name takes the written-out path; same gradients as the eager name."""
    grads = gradients_by_name(**GRADIENTS[scheme])
    assert grads["sdpa"].keys() == grads["eager"].keys()
    for n in grads["sdpa"]:
        assert torch.allclose(grads["sdpa"][n], grads["eager"][n], atol=1e-5), n
    assert grads["sdpa"]["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", ["doge", "qwen4_exp"])
def test_cached_decoding_where_the_family_chooses_the_keys(family, scheme):
    """doge adds a learned bias to its mask and qwen4_exp's indexer hides key blocks from a query, the newest slot
    included: neither is an empty static-cache slot, so cached steps run and equal the full forward."""
    model = hfpatch.patch(tiny.build_tiny(family), **SCHEMES[scheme])
    stepped, full = tiny.stepped_and_full(model)
    assert max_diff(stepped, full) <= 1e-5
    ids = tiny.sample_ids(length=24)
    out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    assert out.shape[1] > ids.shape[1]


# the options each scheme is given where the model is refused before they are read
REFUSED = {"self-extend": dict(position="self-extend", group_size=4, window=16),
           "dual-chunk": dict(position="dual-chunk")}


@pytest.mark.parametrize("scheme", REFUSED)
@pytest.mark.parametrize("family,message", [("gpt2", "is a RoPE scheme, but gpt2 has learned absolute position"),
                                            ("bert", "is a RoPE scheme")])
def test_models_without_rope_are_refused(family, message, scheme):
    assert_refused(tiny_model(family), message, **REFUSED[scheme])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_model_without_a_trained_window_is_refused_with_the_reason(scheme):
    """recurrent_gemma attends locally and its config names no window to take the defaults and the limit from."""
    model = tiny.build_tiny("recurrent_gemma")
    assert scheme not in hfpatch.supported(model)["patches"]["position"]  # (its probe forward sets the state)
    assert_refused(model, "recurrent_gemma's config names none", position=scheme)


@pytest.mark.parametrize("scheme", STATIC)
def test_a_static_cache_is_refused_with_a_clear_error(scheme):
    """Cached keys' positions are inferred (consecutive, ending at the newest query): a StaticCache breaks that."""
    model = hfpatch.patch(tiny_model("llama"), **STATIC[scheme])
    with pytest.raises(ValueError, match=r"a DynamicCache, what generate\(\) uses by default"):
        model.generate(tokens(20), max_new_tokens=2, do_sample=False, pad_token_id=0, cache_implementation="static")
