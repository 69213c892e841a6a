"""Per-layer positions (`layers=` of a RoPE scheme): NoPE or p-RoPE in chosen layers, the global scheme in the rest.
Checked against references that hand those layers' attention cos 1, sin 0 (NoPE) or p-RoPE's cos/sin written from
its definition in float64 (p-RoPE) by forward hooks of their own, on the rest running the plain scheme; through
unpatch, save/reload, cached decoding, describe(), supported(), the spec strings and the command line, and for its
refusals."""

import json

import pytest
import torch
from conftest import WINDOW, assert_same_fingerprint, fingerprint, logits, max_diff, tiny_model, tokens
from handref import cached_and_full
from transformers import AutoModelForCausalLM

import hfpatch
from hfpatch.adapters import adapter_for, get_path
from hfpatch.cli import main
from hfpatch.evaluate.common import parse_patches
from hfpatch.interop.serving import folder_differences
from hfpatch.position import layers as per_layer

LAYERS = 6  # tiny models with enough layers to select some


def model_of(family="llama", **overrides):
    return tiny_model(family, num_hidden_layers=LAYERS, **overrides)


def attention_receives(model, replace: dict):
    """Forward pre-hooks on the attention of the layers in `replace` ({index: fn(cos, sin, position_ids) -> (cos,
    sin)}) that change the position_embeddings the attention is called with; returns the hook handles."""
    def hook(fn):
        def pre(module, args, kwargs):
            cos, sin = kwargs["position_embeddings"]
            kwargs["position_embeddings"] = fn(cos, sin)
            return args, kwargs
        return pre

    adapter = adapter_for(model)  # where the family keeps its blocks and their attention
    blocks = get_path(model.base_model, adapter.layers)
    return [get_path(blocks[i], adapter.attention).register_forward_pre_hook(hook(fn), with_kwargs=True)
            for i, fn in replace.items()]


def hooked_logits(model, ids, replace: dict):
    handles = attention_receives(model, replace)
    try:
        return logits(model, ids)
    finally:
        for h in handles:
            h.remove()


def no_rotation(cos, sin):
    return torch.ones_like(cos), torch.zeros_like(sin)


def p_rope_from_definition(model, keep: float, positions: torch.Tensor, layout: str):
    """p-RoPE's cos/sin in float64 from the definition: frequencies theta^(-2i/d) for the d rotated channels, the
    floor(keep * d/2) highest kept, the others 0; each pair's two channels side by side ("interleaved", cohere),
    half a head apart ("rotate-half", llama), or one value per pair ("half-width", gpt-oss)."""
    cfg = model.config
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    d = int(head * cfg.rope_parameters.get("partial_rotary_factor", 1.0))
    freq = cfg.rope_parameters["rope_theta"] ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    freq[int(keep * (d // 2)):] = 0.0
    angles = positions.double()[..., None] * freq
    emb = {"interleaved": lambda a: a.repeat_interleave(2, -1), "rotate-half": lambda a: torch.cat([a, a], -1),
           "half-width": lambda a: a}[layout](angles)
    return emb.cos().float(), emb.sin().float()


# --------------------------------------------------------------------------------------------- against references

@pytest.mark.parametrize("family,scheme", [
    *((f, {"position": "yarn", "factor": 4.0}) for f in ("llama", "qwen3", "gpt_neox", "phi", "cohere", "gemma2")),
    ("llama", {"position": "rope"}), ("llama", {"position": "dynamic-yarn"}),
])
def test_nope_layers_equal_those_layers_attention_given_no_rotation(family, scheme):
    """The NoPE layers' attention gets cos 1, sin 0, every other layer runs the plain scheme: equal to the model
    patched with the scheme alone whose NoPE layers' attention gets cos 1, sin 0 from a hook of the test's own."""
    ids = tokens(3 * WINDOW)
    plain = hfpatch.patch(model_of(family), **scheme)
    want = hooked_logits(plain, ids, {1: no_rotation, 4: no_rotation})
    got = logits(hfpatch.patch(model_of(family), **scheme, layers={"nope": [1, 4]}), ids)
    assert max_diff(got, want) == 0.0
    assert max_diff(got, logits(plain, ids)) > 1e-6  # the NoPE layers do change the model


@pytest.mark.parametrize("family,layout", [("llama", "rotate-half"), ("cohere", "interleaved"),
                                           ("gpt_neox", "rotate-half"), ("gpt_oss", "half-width")])
def test_p_rope_layers_equal_the_papers_cos_sin_in_those_layers(family, layout):
    """p-RoPE in layers 0 and 3, plain RoPE in the rest: equal to the model with plain RoPE whose layers 0 and 3
    attend with p-RoPE's cos/sin written from the definition (rotate-half, interleaved and half-width layouts, a
    partial rotation)."""
    ids = tokens(2 * WINDOW)
    positions = torch.arange(ids.shape[1])[None]
    model = hfpatch.patch(model_of(family), position="rope")
    cos, sin = p_rope_from_definition(model, 0.5, positions, layout)
    want = hooked_logits(model, ids, {i: (lambda c, s: (cos, sin)) for i in (0, 3)})
    hfpatch.patch(model, position="rope", layers={"p-rope": {"layers": [0, 3], "keep": 0.5}})
    got = logits(model, ids)
    assert max_diff(got, want) < 1e-5
    hfpatch.unpatch(model)
    assert max_diff(logits(model, ids), got) > 1e-6


def test_selectors_pick_the_layers_they_name():
    assert per_layer.selected("every4", 12, "x") == [3, 7, 11]  # Llama 4's iRoPE: the 4th, 8th, 12th layer
    assert per_layer.selected("every4from0", 12, "x") == [0, 4, 8]
    assert per_layer.selected([2, 5], 12, "x") == [2, 5]
    model = hfpatch.patch(model_of(), position="yarn", factor=4.0, layers={"nope": "every3", "p-rope": "every3from0"})
    assert hfpatch.describe(model)["position_layers"] == ["p-rope", "yarn", "nope", "p-rope", "yarn", "nope"]


# ------------------------------------------------------------------------------------------ the usual guarantees

def test_unpatch_is_exact_and_a_second_position_patch_replaces_the_groups():
    model = model_of()
    ids = tokens(2 * WINDOW)
    before = logits(model, ids)
    hfpatch.patch(model, position="yarn", factor=4.0, layers={"nope": "every2", "p-rope": [0]})
    assert type(model.model.layers[1]).__name__.startswith("LayerPositions_")
    hfpatch.patch(model, position="yarn", factor=4.0)  # replaces the position axis: no layer keeps its group
    assert not any(type(b).__name__.startswith("LayerPositions_") for b in model.model.layers)
    hfpatch.patch(model, position="ntk", factor=2.0, layers={"nope": [5]})
    hfpatch.unpatch(model)
    assert max_diff(logits(model, ids), before) == 0.0
    assert all(type(b).__name__ == "LlamaDecoderLayer" for b in model.model.layers)


def test_save_and_reload_give_the_same_logits_and_plain_transformers_the_original(tmp_path):
    model = hfpatch.patch(model_of(), position="yarn", factor=4.0,
                          layers={"nope": "every3", "p-rope": {"layers": [0], "keep": 0.5}})
    assert hfpatch.describe(model)["position"]["native"] is False  # no config class names per-layer positions
    ids = tokens(3 * WINDOW)
    with pytest.warns(UserWarning, match="position='yarn'"):
        hfpatch.save_pretrained(model, tmp_path / "m")
    again = hfpatch.from_pretrained(tmp_path / "m")
    assert max_diff(logits(again, ids), logits(model, ids)) == 0.0
    assert hfpatch.describe(again)["position_layers"] == hfpatch.describe(model)["position_layers"]
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert max_diff(logits(plain, ids), logits(model_of(), ids)) == 0.0
    assert any("per-layer positions" in line for line in folder_differences(str(tmp_path / "m")))


@pytest.mark.parametrize("groups", [{"nope": [1, 4]}, {"p-rope": "every2", "nope": [4]}])
def test_cached_decoding_equals_the_full_forward(groups):
    model = hfpatch.patch(model_of(), position="yarn", factor=4.0, layers=groups)
    cached, full, same = cached_and_full(model)
    assert max_diff(cached, full) < 1e-5
    assert same


def test_gradient_checkpointing_keeps_the_per_layer_positions():
    """The block's class is swapped (not its forward), so gradient checkpointing recomputes with the mix-in."""
    ids = tokens(40, batch=2)
    grads = []
    for checkpointing in (False, True):
        model = hfpatch.patch(model_of(), position="rope", layers={"nope": [1, 4]}).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        model(ids, labels=ids).loss.backward()
        grads.append(model.model.layers[1].self_attn.q_proj.weight.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_describe_and_supported_show_it():
    model = hfpatch.patch(model_of(), position="yarn", factor=4.0, layers={"nope": [2, 5]})
    info = hfpatch.describe(model)
    assert info["position_layers"] == ["yarn", "yarn", "nope", "yarn", "yarn", "nope"]
    assert info["position"]["layers"] == {"nope": [2, 5]}
    assert info["applied"]["position"]["layers"] == {"nope": [2, 5]}
    assert hfpatch.supported(model)["patches"]["position_layers"] == ["nope", "p-rope"]
    gemma3 = hfpatch.supported(tiny_model("gemma3_text"))["patches"]
    assert gemma3["position_layers"] == []
    assert "per layer type" in gemma3["not_available"]["position_layers"]


# ------------------------------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("groups,message", [
    ({"nope": [6]}, "selects layer 6, and this model has 6 layers"),
    ({"nope": "every4from7"}, "selects no layer, and this model has 6 layers"),
    ({"nope": "every2", "p-rope": [3]}, "layer 3 is selected by both 'nope' and 'p-rope'"),
    ({"p-rope": {"layers": [0], "keep": 0.01}}, "leaves no rotary pair"),
])
def test_a_refused_patch_says_why_and_leaves_the_model_as_it_was(groups, message):
    model = hfpatch.patch(model_of(), position="ntk", factor=2.0, layers={"nope": [0]})
    ids = tokens(2 * WINDOW)
    before, prints, spec = logits(model, ids), fingerprint(model), hfpatch.describe(model)["applied"]
    with pytest.raises(ValueError, match=message):
        hfpatch.patch(model, position="yarn", factor=4.0, layers=groups)
    assert max_diff(logits(model, ids), before) == 0.0
    assert_same_fingerprint(fingerprint(model), prints)
    assert hfpatch.describe(model)["applied"] == spec


@pytest.mark.parametrize("kwargs,message", [
    (dict(position="alibi", layers={"nope": [1]}), "go with a RoPE rescaling"),
    (dict(layers={"nope": [1]}), "position='rope' keeps plain RoPE"),
    (dict(position="p-rope", layers={"p-rope": [1]}), "the scheme every other layer has already"),
    (dict(position="yarn", factor=4, layers={"yarn": [1]}), "per-layer positions take nope, p-rope"),
    (dict(position="yarn", factor=4, layers={"nope": [1, 1]}), "layer 1 is listed twice"),
    (dict(position="yarn", factor=4, layers={"nope": "every0"}), "is not a layer selector"),
    (dict(position="yarn", factor=4, layers={"nope": [-1]}), "integers >= 0"),
    (dict(position="yarn", factor=4, layers={"p-rope": {"layers": [1], "keep": 2}}), r"keep must be in \(0, 1\]"),
    (dict(position="yarn", factor=4, layers={"p-rope": {"every": 2}}), "names its layers under 'layers'"),
    (dict(position="yarn", factor=4, layers=[1, 2]), "layers must be a dict"),
])
def test_bad_requests_are_refused_before_the_model_is_touched(kwargs, message):
    with pytest.raises(ValueError, match=message):
        hfpatch.spec.request(**kwargs)


def test_refused_on_per_layer_type_rope():
    model = tiny_model("gemma3_text")
    ids = tokens(60)
    before = logits(model, ids)
    with pytest.raises(ValueError, match="per layer type"):
        hfpatch.patch(model, position="yarn", factor=4.0, layers={"nope": [0]})
    assert max_diff(logits(model, ids), before) == 0.0


@pytest.mark.parametrize("failure", [ValueError("probe failed"), KeyboardInterrupt()])
def test_a_failed_or_interrupted_patch_leaves_the_model_as_it_was(monkeypatch, failure):
    model = hfpatch.patch(model_of(), position="ntk", factor=2.0)
    ids = tokens(2 * WINDOW)
    before, prints, spec = logits(model, ids), fingerprint(model), hfpatch.describe(model)["applied"]

    mixed = []

    def failing_check(model, adapter, plan, overrides):  # after the mix-ins are in
        mixed.extend(i for i, b in enumerate(model.model.layers) if type(b).__name__.startswith("LayerPositions_"))
        raise failure

    monkeypatch.setattr(per_layer, "_check", failing_check)
    with pytest.raises(type(failure)):
        hfpatch.patch(model, position="yarn", factor=4.0, layers={"nope": [1, 3]})
    monkeypatch.undo()
    assert mixed == [1, 3]  # it failed half-way: the layers had their mix-ins
    assert max_diff(logits(model, ids), before) == 0.0
    assert_same_fingerprint(fingerprint(model), prints)
    assert hfpatch.describe(model)["applied"] == spec
    assert all(type(b).__name__ == "LlamaDecoderLayer" for b in model.model.layers)


def test_gguf_export_refuses_it():
    from hfpatch.gguf import request

    with pytest.raises(ValueError, match="layers= has no GGUF form"):
        request(position="yarn", factor=4, layers={"nope": "every4"})


# ------------------------------------------------------------------------------------- spec strings, command line

@pytest.mark.parametrize("text,want", [
    ("yarn:4+nope@every4", {"scheme": "yarn", "factor": 4.0, "layers": {"nope": "every4"}}),
    ("rope+nope@[3,7,11]", {"scheme": "rope", "layers": {"nope": [3, 7, 11]}}),
    ("rope+p-rope@every2from0:keep=0.5+nope@[1]",
     {"scheme": "rope", "layers": {"p-rope": {"layers": "every2from0", "keep": 0.5}, "nope": [1]}}),
])
def test_spec_strings_parse_and_round_trip(text, want):
    spec = hfpatch.spec.request(**hfpatch.spec.parse(text))
    assert spec == {"position": want}
    assert hfpatch.spec.request(**hfpatch.spec.parse(hfpatch.spec.describe_string(spec))) == spec
    assert hfpatch.spec.request(**hfpatch.spec.to_kwargs(spec)) == spec
    assert json.loads(json.dumps(spec)) == spec  # plain data


def test_patches_lists_keep_a_layer_list_whole():
    names = [name for name, _ in parse_patches("none,yarn:4,yarn:4+nope@[3,7,11],yarn:4+nope@every4")]
    assert names == ["none", "yarn:4", "yarn:4+nope@[3,7,11]", "yarn:4+nope@every4"]


def test_command_line_patch_saves_a_model_that_reloads_with_it(tmp_path, capsys):
    src, out = tmp_path / "tiny", tmp_path / "out"
    hfpatch.save_pretrained(model_of(), src)
    assert main(["patch", str(src), "--position", "yarn", "--factor", "4", "--layers", "nope@every3",
                 "--layers", "p-rope@[0]:keep=0.5", "--out", str(out)]) == 0
    assert "yarn:4+nope@every3+p-rope@[0]:keep=0.5" in capsys.readouterr().out
    expected = hfpatch.patch(model_of(), position="yarn", factor=4,
                             layers={"nope": "every3", "p-rope": {"layers": [0], "keep": 0.5}})
    ids = tokens(3 * WINDOW)
    assert max_diff(logits(hfpatch.from_pretrained(out), ids), logits(expected, ids)) == 0.0
    assert main(["describe", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["position_layers"] == ["p-rope", "yarn", "nope", "yarn", "yarn",
                                                                       "nope"]


@pytest.mark.parametrize("argv,message", [
    (["--position", "yarn", "--factor", "4", "--layers", "nope@[9]"], "this model has 6 layers"),
    (["--position", "yarn", "--factor", "4", "--layers", "nope"], "a per-layer group is SCHEME@LAYERS"),
    (["--position", "yarn", "--factor", "4", "--layers", "nope@[1]", "--layers", "nope@[2]"], "same scheme twice"),
    (["--position", "alibi", "--layers", "nope@[1]"], "go with a RoPE rescaling"),
])
def test_command_line_bad_layers_are_one_line_and_exit_2(tmp_path, capsys, argv, message):
    src = tmp_path / "tiny"
    hfpatch.save_pretrained(model_of(), src)
    capsys.readouterr()
    assert main(["patch", str(src), *argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err  # (after transformers' loading bar, where the model is needed to tell)
    assert message in err.strip().splitlines()[-1]
    assert err.count("error") == 1
    assert not (tmp_path / "o").exists()
