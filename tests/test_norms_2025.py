"""DyT (norm="dyt"), Peri-LN (placement="peri") and Mix-LN (placement="mix"): each against a naive formula written
from its paper in float64, its calibration against the loss it says it minimises, exact unpatch, save/reload,
refusals that leave the model as it was, the command line and the heal recipe."""

import json
import math
import warnings

import pytest
import torch
from conftest import REPO, assert_same_fingerprint, fingerprint, logits, max_diff, stdlib_text, tiny_model, tokens

import hfpatch
from hfpatch.adapters import adapter_for, get_path
from hfpatch.cli import main
from hfpatch.norm import fit
from hfpatch.norm.convert import norm_sites
from hfpatch.norm.modules import DyT, read
from hfpatch.norm.placement import OUTPUT_NORMS, post_layers
from hfpatch.tiny import char_text, char_tokenizer


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the plain-swap warning: tested in test_norm.py
        yield


def layers(model):
    return get_path(model.base_model, adapter_for(model).layers)


def naive_rms(x, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def inputs_of(model, module, x):
    """The input `module` gets in a forward of `model` on x."""
    seen = []
    handle = module.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    logits(model, x)
    handle.remove()
    return seen[0]


# ------------------------------------------------------------------------------------------------------------ DyT

@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma", "qwen3"])
def test_dyt_follows_the_formula_with_the_papers_alpha0(family):
    model = tiny_model(family)
    adapter = adapter_for(model)
    old = {p: read(m, adapter.norm_classes) for p, m in norm_sites(model, adapter)}
    old = {p: (o.scale().detach().double().clone(), None if o.bias is None else o.bias.detach().double().clone())
           for p, o in old.items()}
    hfpatch.patch(model, norm="dyt")
    sites = dict(norm_sites(model, adapter))
    assert sites.keys() == old.keys()
    g = torch.Generator().manual_seed(0)
    for path, (gamma, beta) in old.items():
        m = sites[path]
        assert isinstance(m, DyT) and float(m.alpha) == 0.5 and m.alpha.requires_grad
        x = 3 * torch.randn(5, gamma.shape[-1], generator=g, dtype=torch.float64)
        expected = torch.tanh(0.5 * x) * gamma + (0 if beta is None else beta)  # γ·tanh(α0·x) + β
        assert max_diff(m(x.float()).double(), expected) <= 1e-5, path
    info = hfpatch.describe(model)
    assert info["norm"]["kind"] == "dyt" and info["norm"]["exact"] is False
    assert "dyt" in hfpatch.supported(model)["patches"]["norm"]


def test_dyt_on_a_fresh_model_starts_from_the_papers_initialisation():
    model = hfpatch.patch(tiny_model("llama", seed=3), norm="dyt")
    from transformers import AutoModelForCausalLM

    fresh = hfpatch.patch(AutoModelForCausalLM.from_config(model.config.__class__(**{
        k: v for k, v in model.config.to_dict().items() if k != "hfpatch"})), norm="dyt")
    for _, m in norm_sites(fresh, adapter_for(fresh)):
        assert float(m.alpha) == 0.5 and torch.equal(m.weight, torch.ones_like(m.weight))
        assert torch.equal(m.bias, torch.zeros_like(m.bias))


def test_dyt_calibration_minimises_the_weighted_squared_error_to_the_old_norm():
    """The first norm's input (the embeddings) does not depend on any α: its fitted α must minimise
    Σ γ² (tanh(α x) − x / rms(x))², computed here naively in float64 over a fine grid."""
    model = tiny_model("llama")
    first = layers(model)[0].input_layernorm
    gamma, eps = first.weight.detach().double().clone(), first.variance_epsilon
    x = tokens(40, batch=2)
    h = inputs_of(model, first, x).double().reshape(-1, gamma.shape[0])
    hfpatch.patch(model, norm="dyt")
    assert hfpatch.calibrate(model, x) == 5  # 2 blocks x 2 norms + the final norm
    alpha = float(layers(model)[0].input_layernorm.alpha)
    target = naive_rms(h, eps)

    def loss(a):
        return float(((torch.tanh(a * h) - target) ** 2 * gamma ** 2).sum())

    grid = [math.exp(u / 2000) for u in range(-4000, 14000)]  # α from 0.14 to 1100, steps of 0.05 %
    best = min(grid, key=loss)
    assert abs(alpha / best - 1) < 2e-3
    assert loss(alpha) <= loss(best) * (1 + 1e-6)
    assert loss(alpha) < loss(0.5)  # better than the paper's α0 here
    for _, m in norm_sites(model, adapter_for(model)):
        assert float(m.alpha) != 0.5  # every DyT was fit


def test_dyt_calibration_brings_the_logits_closer_and_reloads(tmp_path):
    model = tiny_model("llama")
    x = tokens(40, batch=2)
    before, fp = logits(model, x), fingerprint(model)
    hfpatch.patch(model, norm="dyt")
    plain = max_diff(logits(model, x), before)
    hfpatch.calibrate(model, x)
    calibrated = max_diff(logits(model, x), before)
    assert calibrated < plain
    expected = logits(model, x)
    hfpatch.save_pretrained(model, tmp_path)
    loaded = hfpatch.from_pretrained(tmp_path).eval()
    assert max_diff(logits(loaded, x), expected) == 0.0  # α is saved with the weights
    assert hfpatch.describe(loaded)["norm"]["kind"] == "dyt"
    hfpatch.unpatch(model)
    assert max_diff(logits(model, x), before) == 0.0
    assert_same_fingerprint(fingerprint(model), fp)


def test_an_interrupted_calibration_leaves_every_alpha_as_it_was(monkeypatch):
    model = hfpatch.patch(tiny_model("llama"), norm="dyt")
    fp = fingerprint(model)
    calls = []
    real = fit.fit_alpha

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(fit, "fit_alpha", interrupted)
    with pytest.raises(KeyboardInterrupt):
        hfpatch.calibrate(model, tokens(40))
    assert_same_fingerprint(fingerprint(model), fp)


def test_calibrate_says_what_it_calibrates():
    with pytest.raises(ValueError, match=r"nothing to calibrate .*norm=.dyt. or placement=.peri."):
        hfpatch.calibrate(tiny_model("llama"))


# ------------------------------------------------------------------------------------------------------------ Peri

def peri_by_hand(layer, x, kw, parallel):
    """h = x + O1(Attn(N1(x))); y = h + O2(MLP(N2(h))) (parallel: both branches read x), the output norms as
    the naive RMSNorm / LayerNorm formula in float64."""
    def out_norm(m, y):
        y = y.double()
        if m.kind == "rmsnorm":
            z = naive_rms(y, m.eps)
        else:
            z = (y - y.mean(-1, keepdim=True)) / torch.sqrt(y.var(-1, unbiased=False, keepdim=True) + m.eps)
        return z * (m.weight.double() + m.offset) + (0 if m.bias is None else m.bias.double())

    o1, o2 = (getattr(layer, n) for n in OUTPUT_NORMS)
    attn = layer.self_attn if hasattr(layer, "self_attn") else layer.attention
    n1 = layer.input_layernorm
    n2 = layer.post_attention_layernorm
    a = attn(hidden_states=n1(x), attention_mask=kw.get("attention_mask"), position_ids=kw.get("position_ids"),
             position_embeddings=kw.get("position_embeddings"))[0]
    h = x.double() + out_norm(o1, a)
    return h + out_norm(o2, layer.mlp(n2(x if parallel else h.float())))


def block_call(model, layer, x):
    seen = {}

    def pre(mod, args, kwargs):
        seen["x"], seen["kw"] = (args[0] if args else kwargs["hidden_states"]), dict(kwargs)

    def post(mod, args, kwargs, out):
        seen["out"] = out[0] if isinstance(out, tuple) else out

    h1 = layer.register_forward_pre_hook(pre, with_kwargs=True)
    h2 = layer.register_forward_hook(post, with_kwargs=True)
    logits(model, x)
    h1.remove(), h2.remove()
    return seen["x"], seen["kw"], seen["out"]


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_peri_matches_the_block_written_from_the_paper(family):
    model = tiny_model(family)
    x = tokens(24, batch=2)
    before, fp = logits(model, x), fingerprint(model)
    hfpatch.patch(model, placement="peri")
    hfpatch.calibrate(model, x)  # a scale and bias that are not the unit ones, so the formula has work to do
    layer = layers(model)[1]
    h, kw, out = block_call(model, layer, x)
    with torch.no_grad():
        expected = peri_by_hand(layer, h, kw, parallel=adapter_for(model).parallel)
    assert max_diff(out.double(), expected) <= 1e-5
    assert hfpatch.describe(model)["placement"] == "peri"
    hfpatch.unpatch(model)
    assert max_diff(logits(model, x), before) == 0.0
    assert_same_fingerprint(fingerprint(model), fp)


def test_peri_output_norms_start_as_unit_norms_of_the_blocks_kind():
    model = hfpatch.patch(tiny_model("gemma"), placement="peri")
    for layer in layers(model):
        for name in OUTPUT_NORMS:
            m = getattr(layer, name)
            assert m.kind == "rmsnorm" and m.offset == 1.0 and torch.equal(m.weight, torch.zeros_like(m.weight))


def test_peri_calibration_is_the_per_channel_least_squares_fit():
    """The first block's attention output does not depend on any output norm: the fitted scale (and bias) must be
    the least-squares solution of γ·z + β ≈ y per channel, solved here with lstsq in float64."""
    model = tiny_model("gpt2")  # LayerNorm: an output norm with a bias
    x = tokens(40, batch=2)
    hfpatch.patch(model, placement="peri")
    o1 = getattr(layers(model)[0], OUTPUT_NORMS[0])
    y = inputs_of(model, o1, x).double().reshape(-1, o1.weight.shape[0])
    hfpatch.calibrate(model, x)
    z = (y - y.mean(-1, keepdim=True)) / torch.sqrt(y.var(-1, unbiased=False, keepdim=True) + o1.eps)
    for c in range(0, y.shape[1], 7):
        design = torch.stack([z[:, c], torch.ones_like(z[:, c])], 1)
        gamma, beta = torch.linalg.lstsq(design, y[:, c:c + 1]).solution.flatten().tolist()
        assert o1.weight[c].item() == pytest.approx(gamma, rel=1e-3, abs=1e-6)
        assert o1.bias[c].item() == pytest.approx(beta, rel=1e-3, abs=1e-6)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_peri_calibration_changes_the_model_less_than_unit_output_norms(family):
    model = tiny_model(family)
    x = tokens(40, batch=2)
    before = logits(model, x)
    hfpatch.patch(model, placement="peri")
    unit = max_diff(logits(model, x), before)
    hfpatch.calibrate(model, x)
    calibrated = max_diff(logits(model, x), before)
    assert calibrated < unit / 2


def test_peri_and_dyt_save_reload_and_unpatch(tmp_path):
    model = tiny_model("llama")
    x = tokens(40)
    before, fp = logits(model, x), fingerprint(model)
    hfpatch.patch(model, norm="dyt", placement="peri")
    hfpatch.calibrate(model, x)
    expected = logits(model, x)
    hfpatch.save_pretrained(model, tmp_path)
    loaded = hfpatch.from_pretrained(tmp_path).eval()
    assert max_diff(logits(loaded, x), expected) == 0.0  # the output norms and the αs are in the folder
    assert sorted(hfpatch.describe(loaded)["baked"]) == ["norm", "placement"]
    assert hfpatch.describe(loaded)["placement"] == "peri"
    assert "model.layers.0.hfpatch_mlp_output_norm.weight" in dict(loaded.named_parameters())
    hfpatch.unpatch(model)
    assert max_diff(logits(model, x), before) == 0.0
    assert_same_fingerprint(fingerprint(model), fp)


def saved_peri(folder, family: str, x) -> None:
    """A tiny `family` model with calibrated Peri-LN output norms, saved in `folder`."""
    model = hfpatch.patch(tiny_model(family), placement="peri")
    hfpatch.calibrate(model, x)
    hfpatch.save_pretrained(model, folder)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
@pytest.mark.parametrize("placement", ["pre", "post", "mix"])
def test_a_reloaded_peri_model_takes_another_placement_as_the_original_model_does(tmp_path, family, placement):
    """The output norms are part of the reloaded model; another placement replaces Peri-LN as it does in memory:
    the blocks get the form asked for, from the original pre-norm model (not silently nothing, not an MRO error)."""
    x = tokens(24)
    saved_peri(tmp_path, family, x)
    loaded = hfpatch.from_pretrained(tmp_path).eval()
    peri = logits(loaded, x)
    hfpatch.patch(loaded, placement=placement)
    expected = logits(hfpatch.patch(tiny_model(family), placement=placement), x)
    assert max_diff(logits(loaded, x), expected) == 0.0 and max_diff(expected, peri) > 1e-3
    assert hfpatch.describe(loaded)["placement"] == placement
    assert not any(hasattr(layer, name) for layer in layers(loaded) for name in OUTPUT_NORMS)
    hfpatch.unpatch(loaded)  # back to the model as loaded: its output norms are part of it
    assert max_diff(logits(loaded, x), peri) == 0.0 and hfpatch.describe(loaded)["placement"] == "peri"


def test_an_interrupted_placement_on_a_reloaded_peri_model_leaves_it_as_loaded(tmp_path, monkeypatch):
    from hfpatch.norm import placement

    x = tokens(24)
    saved_peri(tmp_path, "llama", x)
    loaded = hfpatch.from_pretrained(tmp_path).eval()
    peri, fp = logits(loaded, x), fingerprint(loaded)
    real, calls = placement._own_form, []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 2:  # the first block has its own form back already
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(placement, "_own_form", interrupted)
    with pytest.raises(KeyboardInterrupt):
        hfpatch.patch(loaded, placement="post")
    assert len(calls) == 2
    assert_same_fingerprint(fingerprint(loaded), fp)
    assert max_diff(logits(loaded, x), peri) == 0.0 and hfpatch.describe(loaded)["placement"] == "peri"


def test_a_reloaded_peri_model_patched_peri_again_keeps_its_calibrated_output_norms(tmp_path):
    x = tokens(24)
    saved_peri(tmp_path, "llama", x)
    loaded = hfpatch.from_pretrained(tmp_path).eval()
    peri = logits(loaded, x)
    hfpatch.patch(loaded, placement="peri")
    assert max_diff(logits(loaded, x), peri) == 0.0


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_a_reloaded_peri_model_saved_with_another_placement_reloads_without_the_output_norms(tmp_path, placement):
    x = tokens(24)
    saved_peri(tmp_path / "peri", "llama", x)
    loaded = hfpatch.patch(hfpatch.from_pretrained(tmp_path / "peri").eval(), placement=placement)
    expected = logits(loaded, x)
    hfpatch.save_pretrained(loaded, tmp_path / "again")
    again = hfpatch.from_pretrained(tmp_path / "again").eval()
    assert max_diff(logits(again, x), expected) == 0.0
    assert hfpatch.describe(again)["baked"] == []  # nothing of Peri-LN is in the folder, nor built to load it into
    hfpatch.unpatch(again)  # the base model, not a Peri-LN one with output norms the folder does not hold
    assert max_diff(logits(again, x), logits(tiny_model("llama"), x)) == 0.0


def test_the_command_line_evaluates_a_reloaded_peri_model_in_other_placements(tmp_path, capsys):
    saved = tmp_path / "peri"
    hfpatch.save_pretrained(hfpatch.patch(tiny_model("llama"), placement="peri"), saved, tokenizer=char_tokenizer())
    (tmp_path / "doc.txt").write_text(char_text(2000, seed=3))
    assert main(["eval", "ppl", "--model", str(saved), "--patches", "none,placement=pre,placement=post,placement=mix",
                 "--text-files", str(tmp_path / "doc.txt"), "--lengths", "32", "--tokens-per-doc", "600",
                 "--no-plot", "--out", str(tmp_path / "out")]) == 0, capsys.readouterr().err
    cells = json.loads((tmp_path / "out" / "results.json").read_text())["cells"]
    assert len({round(c["ppl"], 9) for c in cells}) == 4, cells  # four placements, four models


# ------------------------------------------------------------------------------------------------------------- Mix

@pytest.mark.parametrize("n,fraction,post", [(4, 0.25, 1), (8, 0.25, 2), (2, 0.25, 1), (4, 0.9, 3), (100, 0.29, 29),
                                             (10, 0.5, 5), (3, 0.5, 1)])
def test_mix_rounds_the_post_norm_count_down_keeping_one_of_each(n, fraction, post):
    assert post_layers(n, fraction) == post


def llama_post_by_hand(layer, x, kw):
    a = layer.self_attn(hidden_states=x, attention_mask=kw.get("attention_mask"), position_ids=kw.get("position_ids"),
                        position_embeddings=kw.get("position_embeddings"))[0]
    h = layer.input_layernorm(x + a)
    return layer.post_attention_layernorm(h + layer.mlp(h))


def llama_pre_by_hand(layer, x, kw):
    a = layer.self_attn(hidden_states=layer.input_layernorm(x), attention_mask=kw.get("attention_mask"),
                        position_ids=kw.get("position_ids"), position_embeddings=kw.get("position_embeddings"))[0]
    h = x + a
    return h + layer.mlp(layer.post_attention_layernorm(h))


def test_mix_is_post_norm_in_the_first_blocks_and_pre_norm_in_the_rest(tmp_path):
    model = tiny_model("llama", num_hidden_layers=4)
    x = tokens(24, batch=2)
    before, fp = logits(model, x), fingerprint(model)
    classes = [type(layer) for layer in layers(model)]
    hfpatch.patch(model, placement="mix", post_fraction=0.5)
    info = hfpatch.describe(model)
    assert info["placement"] == "mix" and info["placement_layers"] == ["post", "post", "pre", "pre"]
    for i, layer in enumerate(layers(model)):
        h, kw, out = block_call(model, layer, x)
        with torch.no_grad():
            expected = (llama_post_by_hand if i < 2 else llama_pre_by_hand)(layer, h, kw)
        assert max_diff(out, expected) <= 1e-5, i
    assert [type(layer) is c for layer, c in zip(layers(model), classes)] == [False, False, True, True]
    patched = logits(model, x)
    assert max_diff(patched, before) > 1e-3
    hfpatch.save_pretrained(model, tmp_path)
    loaded = hfpatch.from_pretrained(tmp_path).eval()
    assert max_diff(logits(loaded, x), patched) == 0.0
    assert hfpatch.describe(loaded)["applied"]["placement"] == {"kind": "mix", "post_fraction": 0.5}
    hfpatch.unpatch(model)
    assert max_diff(logits(model, x), before) == 0.0
    assert_same_fingerprint(fingerprint(model), fp)


def test_mix_default_fraction_is_the_papers():
    model = hfpatch.patch(tiny_model("llama", num_hidden_layers=8), placement="mix")
    assert hfpatch.describe(model)["placement_layers"] == ["post"] * 2 + ["pre"] * 6


@pytest.mark.parametrize("kwargs,message", [
    (dict(placement="mix", post_fraction=0), "0 < post_fraction < 1"),
    (dict(placement="mix", post_fraction=1.0), "0 < post_fraction < 1"),
    (dict(placement="mix", post_fraction=float("nan")), "0 < post_fraction < 1"),
    (dict(placement="mix", post_fraction="0.3"), "must be a number"),
    (dict(placement="mix", post_fraction=True), "must be a number"),
    (dict(post_fraction=0.3), "post_fraction given without placement="),
    (dict(placement="peri", post_fraction=0.3), "placement='peri' takes no option post_fraction"),
    (dict(placement="mix", num_hidden_layers=1), "needs at least 2 blocks"),
    (dict(placement="peri", family="bert"), "placement='peri' is not available for bert: its blocks have the forms"),
    (dict(placement="peri", family="gemma2"), "not available for gemma2"),
    (dict(placement="mix", family="olmo2"), "not available for olmo2"),
    (dict(placement="peri", family="opt"), "not available for opt"),
    (dict(norm="dyt", placement="peri", position="yarn", factor=2.0, family="gpt2"), "RoPE"),
])
def test_refusals_leave_the_model_as_it_was(kwargs, message):
    kwargs = dict(kwargs)
    family = kwargs.pop("family", "llama")
    overrides = {"num_hidden_layers": kwargs.pop("num_hidden_layers")} if "num_hidden_layers" in kwargs else {}
    model = tiny_model(family, **overrides)
    fp = fingerprint(model)
    with pytest.raises(ValueError, match=message):
        hfpatch.patch(model, **kwargs)
    assert_same_fingerprint(fingerprint(model), fp)


def test_an_interrupted_peri_patch_leaves_the_model_as_it_was(monkeypatch):
    from hfpatch.norm import placement

    model = tiny_model("llama")
    fp = fingerprint(model)
    calls = []
    real = placement._add_output_norms

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 2:  # the first block already has its output norms
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(placement, "_add_output_norms", interrupted)
    with pytest.raises(KeyboardInterrupt):
        hfpatch.patch(model, placement="peri")
    assert_same_fingerprint(fingerprint(model), fp)
    assert not any(hasattr(layer, OUTPUT_NORMS[0]) for layer in layers(model))


def test_supported_lists_the_new_patches():
    patches = hfpatch.supported(tiny_model("llama"))["patches"]
    assert "dyt" in patches["norm"] and {"peri", "mix"} <= set(patches["placement"])
    bert = hfpatch.supported(tiny_model("bert"))["patches"]
    assert "mix" in bert["placement"] and "peri" not in bert["placement"]
    assert "no peri form" in bert["not_available"]["placement=peri"]


# ------------------------------------------------------------------------------------------------------ the command

def test_the_command_line_takes_them(tmp_path, capsys):
    src = tmp_path / "llama"
    hfpatch.save_pretrained(tiny_model("llama", num_hidden_layers=4), src)
    out = tmp_path / "mix"
    assert main(["patch", str(src), "--norm", "dyt", "--placement", "mix", "--post-fraction", "0.5", "--out",
                 str(out)]) == 0
    assert "norm=dyt:inexact+placement=mix+post_fraction=0.5" in capsys.readouterr().out
    info = hfpatch.describe(hfpatch.from_pretrained(out))
    assert info["norm"]["kind"] == "dyt" and info["placement_layers"] == ["post", "post", "pre", "pre"]
    assert main(["patch", str(src), "--placement", "peri", "--out", str(tmp_path / "peri")]) == 0
    assert main(["patch", str(src), "--placement", "mix", "--opt", "post_fraction=0.25", "--out",
                 str(tmp_path / "opt")]) == 0
    assert hfpatch.describe(hfpatch.from_pretrained(tmp_path / "opt"))["placement_layers"][0] == "post"
    capsys.readouterr()
    assert main(["patch", str(src), "--placement", "mix", "--post-fraction", "2", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "0 < post_fraction < 1" in err and err.count("\n") == 1 and not (tmp_path / "x").exists()


def llama_with_tokenizer(folder, tokenizer_dir, embedding_scale=1.0):
    """A tiny llama saved in `folder` with the tiny tokenizer (its embeddings times embedding_scale); the tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = tiny_model("llama", vocab_size=len(tok))
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(embedding_scale)
    hfpatch.save_pretrained(model, folder, tokenizer=tok)
    return tok


def test_the_command_line_calibrates_on_a_text_file(tmp_path, tiny_tokenizer_dir, capsys):
    src, out, text = tmp_path / "llama", tmp_path / "dyt", tmp_path / "text.txt"
    tok = llama_with_tokenizer(src, tiny_tokenizer_dir)
    text.write_text(stdlib_text(20_000))
    assert main(["patch", str(src), "--norm", "dyt", "--calibrate", str(text), "--calibrate-tokens", "150",
                 "--out", str(out)]) == 0
    # the reference: the first 150 tokens of the text, in sequences of the model's 64-position window
    ids = tok(text.read_text())["input_ids"][:150]
    reference = hfpatch.patch(hfpatch.from_pretrained(src), norm="dyt")
    hfpatch.calibrate(reference, [torch.tensor([ids[i: i + 64]]) for i in range(0, 150, 64)])
    expected = [float(m.alpha) for m in reference.modules() if isinstance(m, DyT)]
    assert [float(m.alpha) for m in hfpatch.from_pretrained(out).modules() if isinstance(m, DyT)] == expected
    assert all(a != DyT.ALPHA0 for a in expected)


def test_the_command_line_does_not_ask_to_calibrate_what_it_calibrates(tmp_path, tiny_tokenizer_dir, recwarn):
    from hfpatch.utils.warn import NeedsCalibrationWarning

    src, text = tmp_path / "llama", tmp_path / "text.txt"
    # activations so large that BatchNorm's fresh statistics (mean 0, var 1) overflow them
    llama_with_tokenizer(src, tiny_tokenizer_dir, embedding_scale=1e37)
    text.write_text(stdlib_text(5_000))
    assert main(["patch", str(src), "--norm", "batchnorm", "--out", str(tmp_path / "plain")]) == 0
    assert any(issubclass(w.category, NeedsCalibrationWarning) for w in recwarn)
    recwarn.clear()
    assert main(["patch", str(src), "--norm", "batchnorm", "--calibrate", str(text), "--out",
                 str(tmp_path / "calibrated")]) == 0
    assert not any(issubclass(w.category, NeedsCalibrationWarning) for w in recwarn)


@pytest.mark.parametrize("args, message", [
    (["--position", "yarn", "--factor", "2", "--calibrate", "TEXT"], "nothing to calibrate"),
    (["--norm", "dyt", "--calibrate-tokens", "100"], "--calibrate-tokens needs --calibrate TEXT"),
    (["--norm", "dyt", "--calibrate", "TEXT", "--calibrate-tokens", "1"], "--calibrate-tokens must be >= 2"),
    (["--norm", "dyt", "--calibrate", "/no/such.txt"], "--calibrate /no/such.txt: no such file or folder"),
])
def test_the_command_lines_calibration_refusals_are_one_line(tmp_path, tiny_tokenizer_dir, capsys, args, message):
    src, text = tmp_path / "llama", tmp_path / "text.txt"
    llama_with_tokenizer(src, tiny_tokenizer_dir)
    text.write_text(stdlib_text(5_000))
    capsys.readouterr()
    argv = ["patch", str(src), *[str(text) if a == "TEXT" else a for a in args], "--out", str(tmp_path / "x")]
    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]  # (besides progress bars)
    assert len(errors) == 1 and message in errors[0] and not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------------------------------- the recipe

def heal_recipe():
    """recipes/heal.py as a module (recipes are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("heal", REPO / "recipes" / "heal.py")
    heal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(heal)
    return heal


def test_heal_recipe_takes_norm_dyt(tmp_path, tiny_tokenizer_dir):
    from hfpatch.train.cli import run

    heal = heal_recipe()
    text = tmp_path / "text.txt"
    text.write_text(stdlib_text(40_000))
    out, pretrained = tmp_path / "run", tmp_path / "pretrained"
    hfpatch.save_pretrained(tiny_model("llama", vocab_size=400), pretrained)  # the tokenizer has 384 tokens
    argv = [f"model={pretrained}", f"tokenizer={tiny_tokenizer_dir}", "patch={norm: dyt, placement: peri}",
            f"data.text_files=[{text}]", "seq_len=64", "batch_size=1", "max_steps=2", "eval_every=2",
            "save_every=2", "warmup_steps=0", f"output_dir={out}"]
    assert run("heal", heal.main, argv) == 0
    loaded = hfpatch.from_pretrained(out / "final")
    info = hfpatch.describe(loaded)
    assert info["norm"]["kind"] == "dyt" and info["placement"] == "peri"
    alphas = [float(m.alpha) for m in loaded.modules() if isinstance(m, DyT)]
    assert alphas and any(a != 0.5 for a in alphas)  # trained


def test_heal_recipe_calibrates_the_patch_on_training_sequences_before_the_first_step(tmp_path, tiny_tokenizer_dir,
                                                                                      monkeypatch):
    from hfpatch.train import loop
    from hfpatch.train.cli import run

    heal = heal_recipe()
    text = tmp_path / "text.txt"
    text.write_text(stdlib_text(40_000))
    pretrained = tmp_path / "pretrained"
    hfpatch.save_pretrained(tiny_model("llama", vocab_size=400), pretrained)
    seen = {}

    def first_step(cfg, model, tok, train_seqs, eval_seqs, teacher=None):  # what training would start from
        seen["alphas"] = [float(m.alpha) for m in model.modules() if isinstance(m, DyT)]
        seen["seqs"] = train_seqs
        return {}

    monkeypatch.setattr(loop, "train", first_step)
    argv = [f"model={pretrained}", f"tokenizer={tiny_tokenizer_dir}", "patch={norm: dyt}", f"data.text_files=[{text}]",
            "seq_len=64", "batch_size=2", "calibrate=5", f"output_dir={tmp_path / 'run'}"]
    assert run("heal", heal.main, argv) == 0
    # the reference: the same patch on the same model, calibrated by hand on the first 5 training sequences
    reference = hfpatch.patch(hfpatch.from_pretrained(pretrained), norm="dyt")
    hfpatch.calibrate(reference, [seen["seqs"][:2], seen["seqs"][2:4], seen["seqs"][4:5]])
    expected = [float(m.alpha) for m in reference.modules() if isinstance(m, DyT)]
    assert seen["alphas"] == expected and all(a != DyT.ALPHA0 for a in expected)
