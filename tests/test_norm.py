"""Norm swaps and norm placement: exact LayerNorm -> RMSNorm against the unpatched model, plain swaps against the
norm formulas, pre/post placement against a block computed by hand from its submodules, gradient checkpointing."""

import inspect
import warnings

import pytest
import torch
from conftest import FAMILIES, assert_same_fingerprint, fingerprint, logits, max_diff, tiny_config, tiny_model, tokens
from transformers import AutoModel

import hfpatch
from hfpatch.adapters import adapter_for, get_path
from hfpatch.norm.convert import norm_sites
from hfpatch.norm.modules import read

PRE_LN = ["gpt2", "gpt_neox", "opt"]


def hidden(model, x):
    with torch.no_grad():
        return model(x, output_hidden_states=True).hidden_states[-1]


# --------------------------------------------------------------------------------------------------- exact LN -> RMS

EXACT_CASES = {
    "gpt2": {},
    "gpt_neox": {},
    "gpt_neox-sequential": {"use_parallel_residual": False},
    "opt": {},
    "opt-projections": {"word_embed_proj_dim": 32},  # project_in writes the stream, project_out reads the final norm
}


@pytest.mark.parametrize("case", list(EXACT_CASES))
def test_exact_layernorm_to_rmsnorm_preserves_logits(case):
    family = case.split("-")[0]
    model = tiny_model(family, **EXACT_CASES[case])
    x = tokens(48, batch=2)
    before = logits(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # exact: no warning
        hfpatch.patch(model, norm="rmsnorm")
    after = logits(model, x)
    assert max_diff(after, before) <= 1e-4
    info = hfpatch.describe(model)["norm"]
    assert info["kind"] == "rmsnorm" and info["exact"] is True
    for _, m in norm_sites(model, adapter_for(model)):
        p = read(m)
        assert p.kind == "rmsnorm" and p.bias is None
        assert p.weight is None or torch.equal(p.weight, torch.ones_like(p.weight))  # γ folded away
    # a sanity check that the tiny model's norms were not trivial (so folding had work to do)
    assert max_diff(after, logits(tiny_model(family, seed=1, **EXACT_CASES[case]), x)) > 1e-2


def test_exact_conversion_unties_the_head_and_adds_its_bias():
    model = tiny_model("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    hfpatch.patch(model, norm="rmsnorm")
    assert model.lm_head.weight is not model.transformer.wte.weight
    assert model.lm_head.bias is not None and model.config.tie_word_embeddings is False
    # the residual stream is zero-mean: every embedding row is centred
    assert model.transformer.wte.weight.mean(-1).abs().max() < 1e-6
    hfpatch.unpatch(model)
    assert model.lm_head.weight is model.transformer.wte.weight and model.lm_head.bias is None
    assert model.config.tie_word_embeddings is True


def test_exact_conversion_of_a_bare_base_model():
    """No LM head to fold the final norm into: the final RMSNorm keeps γ and β, still exact."""
    model = AutoModel.from_config(tiny_config("gpt2")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    x = tokens(30)
    with torch.no_grad():
        before = model(x).last_hidden_state
        hfpatch.patch(model, norm="rmsnorm")
        after = model(x).last_hidden_state
    assert max_diff(after, before) <= 1e-4
    assert hfpatch.describe(model)["norm"]["exact"] is True


def test_exact_conversion_keeps_training_possible():
    """Gradients flow through the converted model (the folded linears and unit norms are trainable)."""
    model = hfpatch.patch(tiny_model("gpt2"), norm="rmsnorm").train()
    x = tokens(20)
    model(x, labels=x).loss.backward()
    assert model.transformer.h[0].ln_1.weight.grad is not None
    assert model.lm_head.bias.grad is not None


# ------------------------------------------------------------------------------------------------------ plain swaps

def naive_rms(x, scale, bias, eps):
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale
    return y if bias is None else y + bias


def naive_ln(x, scale, bias, eps):
    y = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + eps) * scale
    return y if bias is None else y + bias


def _targets(family):
    return ["layernorm"] if adapter_for(tiny_model(family)).norm == "rmsnorm" else ["rmsnorm"]


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_swap_follows_the_formula(family):
    model = tiny_model(family)
    adapter = adapter_for(model)
    kind = "layernorm" if adapter.norm == "rmsnorm" else "rmsnorm"
    originals = {p: read(m, adapter.norm_classes) for p, m in norm_sites(model, adapter)}
    originals = {p: (o.scale().detach().clone(), None if o.bias is None else o.bias.detach().clone(), o.eps)
                 for p, o in originals.items()}
    hfpatch.patch(model, norm=kind, exact=False)
    sites = dict(norm_sites(model, adapter))
    assert sites.keys() == originals.keys()
    g = torch.Generator().manual_seed(0)
    for path, (scale, bias, eps) in originals.items():
        m = sites[path]
        assert read(m).kind == kind
        assert m.eps == eps
        x = 3 * torch.randn(5, scale.shape[-1], generator=g) + 0.5
        expected = naive_ln(x, scale, bias, eps) if kind == "layernorm" else naive_rms(x, scale, bias, eps)
        assert max_diff(m(x), expected) <= 1e-5, path
    info = hfpatch.describe(model)["norm"]
    assert info["kind"] == kind and info["exact"] is False
    assert info["scale"] == ("1 + weight" if adapter.norm_offset else "weight")


@pytest.mark.parametrize("family,kind,reason", [
    ("llama", "layernorm", "LayerNorm removes the mean"),
    ("gemma3_text", "layernorm", "LayerNorm removes the mean"),
    ("bert", "rmsnorm", "post-norm"),
])
def test_impossible_exactness_warns_once_and_says_so(family, kind, reason):
    hfpatch.norm.convert._WARNED.clear()
    with pytest.warns(UserWarning, match=f"plain swap, not function-preserving: .*{reason}") as record:
        hfpatch.patch(tiny_model(family), norm=kind)
    assert record[0].filename == __file__  # points at the caller's patch() line, not inside hfpatch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = hfpatch.patch(tiny_model(family), norm=kind)  # once
    info = hfpatch.describe(model)["norm"]
    assert info["exact"] is False and reason in info["reason"]


def test_gemma_keeps_its_one_plus_weight_scale():
    model = tiny_model("gemma")
    w = model.model.layers[0].input_layernorm.weight.detach().clone()
    hfpatch.patch(model, norm="layernorm", exact=False)
    new = model.model.layers[0].input_layernorm
    assert new.offset == 1.0 and torch.equal(new.weight, w)  # same stored weight, same 1 + w parametrization


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swap_keeps_dtype_and_upcasts(dtype):
    model = tiny_model("llama").to(dtype)
    hfpatch.patch(model, norm="layernorm", exact=False)
    m = model.model.layers[0].input_layernorm
    assert m.weight.dtype == dtype and m.bias.dtype == dtype
    x = torch.randn(3, 64).to(dtype)
    assert m(x).dtype == dtype
    expected = naive_ln(x.float(), m.weight.float(), m.bias.float(), m.eps).to(dtype)
    assert torch.equal(m(x), expected) or max_diff(m(x).float(), expected.float()) <= 1e-2


def test_same_kind_is_a_no_op():
    model = tiny_model("llama")
    fp = fingerprint(model)
    hfpatch.patch(model, norm="rmsnorm")
    tensors, classes = fingerprint(model)[:2]
    assert classes == fp[1] and all(torch.equal(tensors[k], fp[0][k]) for k in fp[0])
    assert hfpatch.describe(model)["norm"]["exact"] is True


# -------------------------------------------------------------------------------------------------------- placement

def capture_block(model, layer, x):
    """(args, kwargs, output) of one block during a model forward."""
    seen = {}

    def pre(mod, args, kwargs):
        seen["args"], seen["kwargs"] = args, dict(kwargs)

    def post(mod, args, kwargs, out):
        seen["out"] = out

    h1 = layer.register_forward_pre_hook(pre, with_kwargs=True)
    h2 = layer.register_forward_hook(post, with_kwargs=True)
    with torch.no_grad():
        model(x)
    h1.remove(), h2.remove()
    return seen["args"], seen["kwargs"], seen["out"]


def _first(t):
    return t[0] if isinstance(t, tuple) else t


def by_hand(family, layer, h, kw):
    """The block in the other placement, written out from its submodules."""
    drop = lambda name, t: getattr(layer, name)(t) if hasattr(layer, name) else t
    if family == "gpt2":
        a = _first(layer.attn(h, attention_mask=kw.get("attention_mask")))
        h = layer.ln_1(h + a)
        return layer.ln_2(h + layer.mlp(h))
    if family == "gpt_neox":
        a = _first(layer.attention(h, attention_mask=kw.get("attention_mask"), position_ids=kw.get("position_ids"),
                                   position_embeddings=kw.get("position_embeddings")))
        h = layer.input_layernorm(h + a)
        return layer.post_attention_layernorm(h + layer.mlp(h))
    if family == "bert":
        att = layer.attention
        a = _first(att.self(att.output.LayerNorm(h), attention_mask=kw.get("attention_mask")))
        h = h + att.output.dense(a)
        return h + layer.output.dense(layer.intermediate(layer.output.LayerNorm(h)))
    a = _first(layer.self_attn(hidden_states=h, attention_mask=kw.get("attention_mask"),
                               position_ids=kw.get("position_ids"), position_embeddings=kw.get("position_embeddings")))
    h = layer.input_layernorm(h + drop("resid_attn_dropout", a))
    return layer.post_attention_layernorm(h + drop("resid_mlp_dropout", layer.mlp(h)))


PLACEMENT = [("llama", "post"), ("mistral", "post"), ("qwen2", "post"), ("qwen3", "post"), ("gemma", "post"),
             ("phi3", "post"), ("gpt2", "post"), ("gpt_neox", "post"), ("bert", "pre")]


@pytest.mark.parametrize("family,where", PLACEMENT)
def test_placement_matches_the_block_written_by_hand(family, where):
    model = tiny_model(family)
    x = tokens(24, batch=2)
    before = logits(model, x)
    original_class = type(get_path(model.base_model, adapter_for(model).layers)[1])
    hfpatch.patch(model, placement=where)
    layer = get_path(model.base_model, adapter_for(model).layers)[1]
    assert isinstance(layer, original_class) and type(layer) is not original_class  # a subclass, not a new forward
    assert "forward" not in vars(layer)
    args, kwargs, out = capture_block(model, layer, x)
    named = inspect.signature(original_class.forward).bind(layer, *args, **kwargs).arguments
    named.update(named.pop("kwargs", {}))
    with torch.no_grad():
        expected = by_hand(family, layer, named["hidden_states"], named)
    assert max_diff(_first(out), expected) <= 1e-5
    assert max_diff(logits(model, x), before) > 1e-3
    assert hfpatch.describe(model)["placement"] == where
    hfpatch.unpatch(model)
    assert type(layer) is original_class
    assert max_diff(logits(model, x), before) == 0.0


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox", "bert"])
def test_gradient_checkpointing_still_works_after_a_class_swap(family):
    """Checkpointing re-runs each block's forward in the backward pass: the swapped forward must be the one
    re-run, and gradients must equal those without checkpointing."""
    where = "pre" if family == "bert" else "post"
    grads = {}
    calls = {}
    for ckpt in (False, True):
        model = hfpatch.patch(tiny_model(family), placement=where).train()
        for mod in model.modules():
            if hasattr(mod, "dropout") and isinstance(mod.dropout, float):
                mod.dropout = 0.0
        for mod in model.modules():
            if isinstance(mod, torch.nn.Dropout):
                mod.p = 0.0
        adapter = adapter_for(model)
        first = get_path(model.base_model, adapter.layers)[0]
        norm = get_path(first, adapter.norms[0])
        count = [0]
        norm.register_forward_hook(lambda *a, count=count: count.__setitem__(0, count[0] + 1))
        if ckpt:
            model.activation_checkpointing_enable({"use_reentrant": False})
        x = tokens(16)
        out = model(x).logits
        out.float().pow(2).mean().backward()
        grads[ckpt] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        calls[ckpt] = count[0]
    assert calls[True] == 2 * calls[False]  # forward, then the recomputation in backward
    assert grads[True].keys() == grads[False].keys()
    for name in grads[False]:
        assert torch.allclose(grads[True][name], grads[False][name], atol=1e-6), name


@pytest.mark.parametrize("family,message", [
    ("gemma2", "not available for gemma2 \\(its blocks use 'sandwich' norms"),
    ("olmo2", "not available for olmo2"),
    ("opt", "not available for opt"),
])
def test_placement_where_it_does_not_apply(family, message):
    model = tiny_model(family)
    fp = fingerprint(model)
    with pytest.raises(ValueError, match=message):
        hfpatch.patch(model, placement="post")
    assert_same_fingerprint(fingerprint(model), fp)


def test_same_placement_is_a_no_op():
    model = tiny_model("llama")
    classes = {n: type(m) for n, m in model.named_modules()}
    hfpatch.patch(model, placement="pre")
    assert {n: type(m) for n, m in model.named_modules()} == classes


# ------------------------------------------------------------------------------------------------------ composition

@pytest.mark.parametrize("family,kwargs", [
    ("gpt2", dict(norm="rmsnorm", placement="post")),
    ("gpt_neox", dict(norm="rmsnorm", position="yarn", factor=2.0)),
    ("llama", dict(norm="layernorm", placement="post", position="ntk", factor=2.0)),
    ("qwen3", dict(norm="layernorm", position="dynamic-yarn")),
    ("bert", dict(norm="rmsnorm", placement="pre")),
])
def test_everything_composes_saves_and_unpatches(tmp_path, family, kwargs):
    model = tiny_model(family)
    model.save_pretrained(tmp_path / "unpatched")  # transformers' save fills config fields (architectures, dtype)
    x = tokens(100 if "position" in kwargs else 40)
    before, fp = logits(model, x), fingerprint(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hfpatch.patch(model, **kwargs)
        patched = logits(model, x)
        hfpatch.save_pretrained(model, tmp_path / "patched")
    loaded = hfpatch.from_pretrained(tmp_path / "patched").eval()
    assert max_diff(logits(loaded, x), patched) == 0.0
    assert hfpatch.describe(loaded)["applied"] == hfpatch.describe(model)["applied"]
    assert hfpatch.describe(loaded)["norm"] == hfpatch.describe(model)["norm"]
    hfpatch.unpatch(model)
    assert max_diff(logits(model, x), before) == 0.0
    assert_same_fingerprint(fingerprint(model), fp)


def test_reloaded_norm_swap_is_part_of_the_model(tmp_path):
    """A norm swap reloads with its saved weights; unpatch then keeps it (the original weights are not in the
    folder) and undoes only the patches applied after loading."""
    model = hfpatch.patch(tiny_model("gpt2"), norm="rmsnorm")
    x = tokens(40)
    expected = logits(model, x)
    hfpatch.save_pretrained(model, tmp_path)
    loaded = hfpatch.from_pretrained(tmp_path).eval()
    assert hfpatch.describe(loaded)["baked"] == ["norm"]
    assert "lm_head.bias" in dict(loaded.named_parameters())
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in loaded.modules())
    hfpatch.patch(loaded, placement="post")
    hfpatch.unpatch(loaded)
    assert max_diff(logits(loaded, x), expected) == 0.0
    assert hfpatch.describe(loaded)["applied"] == {"norm": {"kind": "rmsnorm", "exact": True}}


def test_failure_after_the_norm_swap_rolls_it_back():
    model = tiny_model("gpt2")
    fp = fingerprint(model)
    with pytest.raises(ValueError, match="RoPE scheme"):
        hfpatch.patch(model, norm="rmsnorm", position="yarn", factor=2)  # norm applies first, then position fails
    assert_same_fingerprint(fingerprint(model), fp)
