"""save_pretrained / from_pretrained: identical logits after a round trip; native RoPE forms reload in plain
transformers."""

import json

import pytest
from conftest import ROPE_FAMILIES, WINDOW, logits, max_diff, tiny_model, tokens
from transformers import AutoModelForCausalLM

import hfpatch

NATIVE = [dict(position="linear", factor=2.0), dict(position="ntk", factor=2.0), dict(position="dynamic", factor=2.0),
          dict(position="yarn", factor=4.0), dict(position="llama3", factor=4.0), dict(position="rope")]


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt_neox", "qwen3"])
@pytest.mark.parametrize("kwargs", [*NATIVE, dict(position="dynamic-yarn")], ids=lambda k: k["position"])
@pytest.mark.filterwarnings("ignore:position='dynamic-yarn' has no rope_parameters form")
def test_round_trip(tmp_path, family, kwargs):
    model = hfpatch.patch(tiny_model(family), **kwargs)
    x = tokens(160)
    expected = logits(model, x)
    hfpatch.save_pretrained(model, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["hfpatch"]["spec"]["position"]["scheme"] == kwargs["position"]
    loaded = hfpatch.from_pretrained(tmp_path).eval()
    assert max_diff(logits(loaded, x), expected) == 0.0
    assert hfpatch.describe(loaded)["applied"] == hfpatch.describe(model)["applied"]
    # and the reloaded model unpatches to the original
    hfpatch.unpatch(loaded)
    assert max_diff(logits(loaded, x), logits(tiny_model(family), x)) == 0.0


@pytest.mark.parametrize("family", ROPE_FAMILIES)
@pytest.mark.parametrize("kwargs", NATIVE, ids=lambda k: k["position"])
def test_native_forms_reload_without_hfpatch(tmp_path, family, kwargs):
    if family == "phi3" and kwargs["position"] not in ("rope", "ntk"):
        pytest.skip("Phi3Config accepts only default/longrope: "
                    "see test_non_native_schemes_warn_and_reload_through_hfpatch")
    model = hfpatch.patch(tiny_model(family), **kwargs)
    x = tokens(160)
    hfpatch.save_pretrained(model, tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert max_diff(logits(plain, x), logits(model, x)) == 0.0


def test_longrope_reloads_natively_on_phi3(tmp_path):
    model = hfpatch.patch(tiny_model("phi3"), position="longrope", factor=4.0, short_factor=[1.0] * 8,
                          long_factor=[1.5 + i for i in range(8)])
    hfpatch.save_pretrained(model, tmp_path)
    x = tokens(160)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert max_diff(logits(plain, x), logits(model, x)) == 0.0


@pytest.mark.parametrize("family,kwargs", [("phi3", dict(position="yarn", factor=2.0)),
                                           ("llama", dict(position="dynamic-yarn"))])
def test_non_native_schemes_warn_and_reload_through_hfpatch(tmp_path, family, kwargs):
    model = hfpatch.patch(tiny_model(family), **kwargs)
    assert hfpatch.describe(model)["position"]["native"] is False
    x = tokens(160)
    with pytest.warns(UserWarning, match="plain transformers loads the model.s original position"):
        hfpatch.save_pretrained(model, tmp_path)
    assert max_diff(logits(hfpatch.from_pretrained(tmp_path), x), logits(model, x)) == 0.0
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert max_diff(logits(plain, x), logits(tiny_model(family), x)) == 0.0


def test_unpatched_model_round_trip_and_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    model = tiny_model("gpt2")
    hfpatch.save_pretrained(model, tmp_path, tokenizer=fast)
    assert (tmp_path / "tokenizer.json").exists()
    x = tokens(40)
    assert max_diff(logits(hfpatch.from_pretrained(tmp_path), x), logits(model, x)) == 0.0


def test_model_save_pretrained_keeps_the_record(tmp_path):
    """The record lives in the config, so transformers' own save_pretrained writes it too."""
    model = hfpatch.patch(tiny_model("llama"), position="yarn", factor=2)
    model.save_pretrained(tmp_path)
    loaded = hfpatch.from_pretrained(tmp_path)
    assert hfpatch.describe(loaded)["applied"] == {"position": {"scheme": "yarn", "factor": 2.0}}
    assert loaded.config.max_position_embeddings == 2 * WINDOW


def test_unreadable_record(tmp_path):
    model = tiny_model("llama")
    model.config.hfpatch = {"version": 99}
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unreadable hfpatch section"):
        hfpatch.from_pretrained(tmp_path)
