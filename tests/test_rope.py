"""RoPE scaling on every RoPE family: equal to transformers' native configuration where one exists, to the papers'
formulas where not (ntk, dynamic-yarn); generate() with a KV cache keeps working."""

import copy
import math

import pytest
import torch
from conftest import ROPE_FAMILIES, WINDOW, cached_step_and_full, logits, max_diff, native_model, tiny_model, tokens

import hfpatch

L = 160  # > 2 * WINDOW: the scaled regime


def n_freq(model):
    rotary = model.base_model.rotary_emb
    name = "full_attention_inv_freq" if hasattr(rotary, "full_attention_inv_freq") else "inv_freq"
    return getattr(rotary, name).numel()


def base_params(model):
    """The model's original RoPE parameters: what a natively scaled config starts from."""
    return copy.deepcopy(model.config.rope_parameters)


def native_rope(model, scheme_params):
    """rope_parameters of the native equivalent: the scheme on the global layers of gemma3, the whole model else."""
    base = base_params(model)
    if "full_attention" in base:
        full = {**{k: base["full_attention"][k] for k in ("rope_theta",)}, **scheme_params}
        return {**base, "full_attention": full}
    carried = {k: base[k] for k in ("rope_theta", "partial_rotary_factor") if k in base}
    return {**carried, **scheme_params}


def native_cases(nf):
    orig = {"original_max_position_embeddings": WINDOW}
    short = [1.0 + 0.1 * i for i in range(nf)]
    long = [2.0 + 0.5 * i for i in range(nf)]
    # (hfpatch kwargs, native rope_parameters, native max_position_embeddings)
    return {
        "rope": ({"position": "rope"}, {"rope_type": "default"}, WINDOW),
        "linear": ({"position": "linear", "factor": 2.5}, {"rope_type": "linear", "factor": 2.5}, 160),
        "dynamic": ({"position": "dynamic", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0}, WINDOW),
        "dynamic-nofactor": ({"position": "dynamic"}, {"rope_type": "dynamic", "factor": 1.0}, WINDOW),
        "yarn": ({"position": "yarn", "factor": 4.0}, {"rope_type": "yarn", "factor": 4.0, **orig}, 4 * WINDOW),
        "yarn-options": (
            {"position": "yarn", "factor": 3.0, "beta_fast": 16, "beta_slow": 2, "attention_factor": 1.2},
            {"rope_type": "yarn", "factor": 3.0, "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.2, **orig},
            3 * WINDOW,
        ),
        "llama3": (
            {"position": "llama3", "factor": 8.0},
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, **orig},
            8 * WINDOW,
        ),
        "longrope": (
            {"position": "longrope", "factor": 4.0, "short_factor": short, "long_factor": long},
            {"rope_type": "longrope", "factor": 4.0, "short_factor": short, "long_factor": long, **orig},
            4 * WINDOW,
        ),
    }


CASES = list(native_cases(4))


@pytest.mark.parametrize("family", ROPE_FAMILIES)
@pytest.mark.parametrize("case", CASES)
def test_native_schemes_match_transformers(family, case):
    model = tiny_model(family)
    kwargs, scheme_params, mpe = native_cases(n_freq(model))[case]
    x = tokens(L)
    before = logits(model, x)
    native = native_model(family, model, native_rope(model, scheme_params), mpe)
    hfpatch.patch(model, **kwargs)
    after = logits(model, x)
    assert max_diff(after, logits(native, x)) <= 1e-6
    if case not in ("rope",):
        assert max_diff(after, before) > 1e-4, "the patch changed nothing"
    else:
        assert max_diff(after, before) == 0.0
    assert model.config.max_position_embeddings == mpe


@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_ntk_is_the_papers_base_change(family):
    """NTK-aware: b' = b * s^(d/(d-2)), d = rotated channels; plain RoPE with that base otherwise."""
    model = tiny_model(family)
    x = tokens(L)
    s = 3.0
    base = base_params(model)
    params = base.get("full_attention", base)
    d = int((model.config.head_dim if getattr(model.config, "head_dim", None) else
             model.config.hidden_size // model.config.num_attention_heads) * params.get("partial_rotary_factor", 1.0))
    theta = params["rope_theta"] * s ** (d / (d - 2))
    hfpatch.patch(model, position="ntk", factor=s)
    rotary = model.base_model.rotary_emb
    inv_freq = getattr(rotary, "full_attention_inv_freq", None)
    inv_freq = rotary.inv_freq if inv_freq is None else inv_freq
    expected = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    assert torch.allclose(inv_freq.double(), expected, rtol=1e-6, atol=0)
    native = native_model(family, model, native_rope(model, {"rope_type": "default", "rope_theta": theta}),
                          math.ceil(WINDOW * s))
    assert max_diff(logits(model, x), logits(native, x)) <= 1e-6


def yarn_mscale(s):
    return 0.1 * math.log(s) + 1.0  # YaRN paper, eq. for sqrt(1/t)


@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_dynamic_yarn_follows_the_length(family):
    """Dynamic YaRN: s = max(1, L/L_orig), recomputed as the sequence grows (and shrinks)."""
    model = tiny_model(family)
    short, long = tokens(WINDOW - 4), tokens(L)
    plain_short = logits(model, short)
    hfpatch.patch(model, position="dynamic-yarn")
    # L <= L_orig: plain RoPE
    assert max_diff(logits(model, short), plain_short) == 0.0
    # L > L_orig: YaRN with s = L / L_orig, as transformers' static yarn computes it
    s = L / WINDOW
    native = native_model(family, model, native_rope(model, {"rope_type": "yarn", "factor": s,
                                                             "original_max_position_embeddings": WINDOW}), L)
    assert max_diff(logits(model, long), logits(native, long)) <= 1e-6
    rotary = model.base_model.rotary_emb
    scaling = getattr(rotary, "full_attention_attention_scaling", getattr(rotary, "attention_scaling", None))
    assert scaling == pytest.approx(yarn_mscale(s), rel=1e-12)
    # shorter again: back to plain RoPE, attention scaling included
    assert max_diff(logits(model, short), plain_short) == 0.0


def test_dynamic_yarn_factor_caps_the_scale():
    model = tiny_model("llama")
    hfpatch.patch(model, position="dynamic-yarn", factor=2.0)
    x = tokens(L)  # L / L_orig = 2.5 > cap
    native = native_model("llama", model, native_rope(model, {"rope_type": "yarn", "factor": 2.0,
                                                              "original_max_position_embeddings": WINDOW}), 128)
    assert max_diff(logits(model, x), logits(native, x)) <= 1e-6
    assert model.config.max_position_embeddings == 2 * WINDOW


def test_gemma3_layer_types():
    """By default only the global (full_attention) layers are scaled, as transformers' rope_scaling does; the
    sliding layers can be named too."""
    model = tiny_model("gemma3_text")
    base = base_params(model)
    rotary = model.base_model.rotary_emb
    sliding = rotary.sliding_attention_inv_freq.clone()
    full = rotary.full_attention_inv_freq.clone()
    hfpatch.patch(model, position="linear", factor=2.0)
    assert torch.equal(rotary.sliding_attention_inv_freq, sliding)
    assert torch.allclose(rotary.full_attention_inv_freq, full / 2.0, rtol=1e-6)
    hfpatch.patch(model, position="linear", factor=2.0, layer_types=["full_attention", "sliding_attention"])
    assert torch.allclose(rotary.sliding_attention_inv_freq, sliding / 2.0, rtol=1e-6)
    x = tokens(L)
    both = {lt: {"rope_theta": base[lt]["rope_theta"], "rope_type": "linear", "factor": 2.0} for lt in base}
    native = native_model("gemma3_text", model, both, 2 * WINDOW)
    assert max_diff(logits(model, x), logits(native, x)) <= 1e-6


def test_gpt_neox_partial_rotary_keeps_its_fraction():
    model = tiny_model("gpt_neox")
    hfpatch.patch(model, position="yarn", factor=2.0)
    assert model.config.rope_parameters["partial_rotary_factor"] == 0.25
    assert model.base_model.rotary_emb.inv_freq.numel() == 4  # 32 * 0.25 / 2


@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_kv_cache_decode_equals_full_forward(family):
    """After the patch, one cached decode step gives the logits of the full forward, and greedy generate() with
    the cache equals generate() without it."""
    model = tiny_model(family)
    hfpatch.patch(model, position="yarn", factor=4.0)
    x = tokens(100)
    step, full = cached_step_and_full(model, x)
    assert max_diff(step, full) <= 1e-5
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(x, use_cache=True, **kw)
        uncached = model.generate(x, use_cache=False, **kw)
    assert cached.shape == (1, 106)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("scheme", ["dynamic", "dynamic-yarn"])
def test_generate_runs_with_dynamic_schemes(scheme):
    model = tiny_model("llama")
    hfpatch.patch(model, position=scheme)
    with torch.no_grad():
        out = model.generate(tokens(100), max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 105)
