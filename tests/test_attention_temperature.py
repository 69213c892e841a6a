"""attention_temperature= (logn, llama4): the query scaled by s(position) inside the attention function. Checked
against a reference that scales the query projection's output position by position with the papers' formulas (written
here with math.log, in float64), for exactness inside the trained window, on top of other position schemes, through
save/reload, unpatch, cached decoding, the spec strings and the command line, and for its refusals."""

import dataclasses
import json
import math

import pytest
import torch
from conftest import FAMILIES, WINDOW, assert_same_fingerprint, fingerprint, logits, max_diff, tiny_model, tokens
from handref import cached_and_full, padded

import hfpatch
from hfpatch.adapters import adapter_for, set_adapter
from hfpatch.cli import main
from hfpatch.evaluate.common import parse_patches
from hfpatch.position.attention import temperature


def logn(p: int, window: int) -> float:
    """Qwen's logn attention at the 1-based position p."""
    return max(1.0, math.log(p) / math.log(window))


def llama4(p: int, attn_scale: float, floor_scale: int) -> float:
    """Llama 4's temperature tuning at the 0-based position p."""
    return 1.0 + attn_scale * math.log(math.floor((p + 1) / floor_scale) + 1)


def scaled_reference(model, ids, scale, where="q_proj"):
    """Logits of `model` with the output of every layer's `where` (q_proj: [b, L, H·d], q_norm: [b, L, H, d])
    multiplied by scale(p) at the 0-based position p."""
    s = torch.tensor([scale(p) for p in range(ids.shape[1])], dtype=torch.float64)

    def hook(module, args, out):
        shape = (1, -1) + (1,) * (out.dim() - 2)
        return (out.double() * s.view(shape)).to(out.dtype)

    handles = [getattr(layer.self_attn, where).register_forward_hook(hook) for layer in model.model.layers]
    try:
        return logits(model, ids)
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("position", [{}, {"position": "yarn", "factor": 4.0}, {"position": "alibi"}])
def test_logn_past_the_window_equals_scaling_the_query_projection(attn, position):
    model = tiny_model("llama", attn_implementation=attn)
    hfpatch.patch(model, **position)
    ids = tokens(4 * WINDOW)
    plain, want = logits(model, ids), scaled_reference(model, ids, lambda p: logn(p + 1, WINDOW))
    hfpatch.patch(model, attention_temperature="logn")
    got = logits(model, ids)
    assert max_diff(got, want) < 1e-5
    assert max_diff(got, plain) > 1e-3  # the temperature does change them


def test_llama4_past_floor_scale_equals_scaling_the_query_projection():
    model = tiny_model("llama")
    ids = tokens(4 * WINDOW)
    want = scaled_reference(model, ids, lambda p: llama4(p, 0.5, 16))
    hfpatch.patch(model, attention_temperature={"kind": "llama4", "attn_scale": 0.5, "floor_scale": 16})
    assert max_diff(logits(model, ids), want) < 1e-5


def test_the_query_is_scaled_after_the_qk_norm():
    """qwen3 normalizes each query head: a scale before the norm would vanish, after it (where Qwen and Llama 4 put
    it) it does not."""
    model = tiny_model("qwen3")
    ids = tokens(3 * WINDOW)
    want = scaled_reference(model, ids, lambda p: logn(p + 1, WINDOW), where="q_norm")
    hfpatch.patch(model, attention_temperature="logn")
    assert max_diff(logits(model, ids), want) < 1e-5


@pytest.mark.parametrize("position", [{}, {"position": "yarn", "factor": 4.0}, {"position": "alibi"},
                                      {"position": "nope"}, {"position": "p-rope"}, {"position": "self-extend"},
                                      {"position": "dual-chunk"}, {"position": "t5"}])
@pytest.mark.parametrize("kind", [{"kind": "logn"}, {"kind": "llama4", "floor_scale": WINDOW + 1}])
def test_inside_the_window_the_logits_are_the_models_own_exactly(position, kind):
    model = hfpatch.patch(tiny_model("llama"), **position)
    ids = tokens(WINDOW)
    before = logits(model, ids)
    hfpatch.patch(model, attention_temperature=kind)
    assert max_diff(logits(model, ids), before) == 0.0


@pytest.mark.parametrize("kind", ["logn", "llama4"])
def test_unpatch_is_exact(kind):
    model = tiny_model("llama")
    ids = tokens(3 * WINDOW)
    before, prints = logits(model, ids), fingerprint(model)
    hfpatch.patch(model, position="yarn", factor=4, attention_temperature={"kind": kind, **(
        {"floor_scale": 8} if kind == "llama4" else {})})
    assert max_diff(logits(model, ids), before) > 0.0
    hfpatch.unpatch(model)
    assert max_diff(logits(model, ids), before) == 0.0
    assert_same_fingerprint(fingerprint(model), prints)
    assert model.config._attn_implementation == "sdpa"


def test_save_and_reload_give_the_same_logits(tmp_path):
    model = hfpatch.patch(tiny_model("llama"), position="yarn", factor=4,
                          attention_temperature={"kind": "logn", "window": 32})
    ids = tokens(3 * WINDOW)
    with pytest.warns(UserWarning, match="attention_temperature='logn' has no form"):
        hfpatch.save_pretrained(model, tmp_path / "m")
    again = hfpatch.from_pretrained(tmp_path / "m")
    assert max_diff(logits(again, ids), logits(model, ids)) == 0.0
    assert hfpatch.describe(again)["attention_temperature"] == {"kind": "logn", "window": 32}
    assert hfpatch.describe(again)["applied"]["position"]["scheme"] == "yarn"


def test_save_and_reload_on_top_of_a_weight_changing_scheme(tmp_path):
    model = hfpatch.patch(tiny_model("llama"), position="t5", attention_temperature="llama4")
    with torch.no_grad():  # trained T5 biases, so that the reload has something to get right
        for p in model.parameters():
            if p.ndim == 2 and p.shape[-1] == model.config.num_attention_heads:
                p.normal_()
    ids = tokens(2 * WINDOW)
    with pytest.warns(UserWarning):
        hfpatch.save_pretrained(model, tmp_path / "m")
    again = hfpatch.from_pretrained(tmp_path / "m")
    assert max_diff(logits(again, ids), logits(model, ids)) == 0.0


@pytest.mark.parametrize("kind", [{"kind": "logn", "window": 16}, {"kind": "llama4", "floor_scale": 8}])
def test_cached_decoding_equals_the_full_forward(kind):
    model = hfpatch.patch(tiny_model("llama"), attention_temperature=kind)
    cached, full, same = cached_and_full(model)
    assert max_diff(cached, full) < 1e-5
    assert same


@pytest.mark.parametrize("kind", [{"kind": "logn", "window": 16}, {"kind": "llama4", "floor_scale": 8}])
def test_left_padded_rows_scale_by_the_positions_of_their_real_tokens(kind):
    """generate() passes position ids that count real tokens only: a left-padded row gets the logits it gets
    alone, not those of positions shifted by its padding."""
    model = hfpatch.patch(tiny_model("llama"), attention_temperature=kind)
    ids, keep, pos = padded(70, "left")
    with torch.no_grad():
        batched = model(ids, attention_mask=keep, position_ids=pos).logits[1, 13:]
        alone = model(ids[1:, 13:]).logits[0]
    assert max_diff(batched, alone) < 1e-5


def test_describe_and_supported_show_it():
    model = tiny_model("llama")
    assert hfpatch.describe(model)["attention_temperature"] is None
    assert hfpatch.supported(model)["patches"]["attention_temperature"] == ["logn", "llama4"]
    hfpatch.patch(model, attention_temperature="llama4")
    info = hfpatch.describe(model)
    assert info["attention_temperature"] == {"kind": "llama4", "attn_scale": 0.1, "floor_scale": 8192}
    assert info["applied"] == {"temperature": {"kind": "llama4"}}
    assert hfpatch.spec.describe_string(info["applied"]) == "attention_temperature=llama4"


# ------------------------------------------------------------------------------------------------- spec strings

def test_spec_strings_parse_and_round_trip():
    parsed = hfpatch.spec.parse("yarn:4+attention_temperature=logn")
    assert parsed == {"position": "yarn", "factor": 4.0, "attention_temperature": "logn"}
    text = "attention_temperature=llama4:attn_scale=0.2:floor_scale=4096"
    spec = hfpatch.spec.request(**hfpatch.spec.parse(text))
    assert spec == {"temperature": {"kind": "llama4", "attn_scale": 0.2, "floor_scale": 4096}}
    assert hfpatch.spec.describe_string(spec) == text
    assert hfpatch.spec.request(**hfpatch.spec.to_kwargs(spec)) == spec
    assert [name for name, _ in parse_patches("none,yarn:4,yarn:4+attention_temperature=logn")] == \
        ["none", "yarn:4", "yarn:4+attention_temperature=logn"]


@pytest.mark.parametrize("text,message", [
    ("attention_temperature=logm", "unknown attention_temperature 'logm'; valid: logn, llama4"),
    ("attention_temperature=logn:windw=4096", "does not take windw; it accepts: window"),
    ("attention_temperature=logn:window=1", "window must be at least 2"),
    ("attention_temperature=llama4:attn_scale=-1", "attn_scale must be > 0"),
    ("attention_temperature=llama4:floor_scale=0.5", "floor_scale must be a positive integer"),
    ("attention_temperature=logn:4096", "expected key=value"),
])
def test_bad_temperature_specs_are_refused_saying_what_is_accepted(text, message):
    with pytest.raises((ValueError, TypeError), match=message):
        hfpatch.spec.request(**hfpatch.spec.parse(text))


def test_a_temperature_option_given_on_its_own_says_where_it_goes():
    with pytest.raises(ValueError, match=r"attention_temperature=\{'kind': \.\.\., 'window'"):
        hfpatch.patch(tiny_model("llama"), attention_temperature="logn", window=4096)


# ----------------------------------------------------------------------------------------------------- refusals

def test_refused_where_attention_does_not_go_through_the_interface():
    model = tiny_model("llama")
    set_adapter(model, dataclasses.replace(adapter_for(model), attention_interface=False,
                                           notes={"attention": "its attention computes the scores itself"}))
    with pytest.raises(ValueError, match="does not go through transformers' attention interface"):
        hfpatch.patch(model, attention_temperature="llama4")
    assert hfpatch.supported(model)["patches"]["attention_temperature"] == []


def test_logn_needs_a_window_where_the_config_names_none():
    model = tiny_model("llama")
    set_adapter(model, dataclasses.replace(adapter_for(model), window=None))
    ids = tokens(2 * WINDOW)
    before = logits(model, ids)
    with pytest.raises(ValueError, match=r"config names none.*'window': 4096"):
        hfpatch.patch(model, attention_temperature="logn")
    assert max_diff(logits(model, ids), before) == 0.0
    assert "logn" not in hfpatch.supported(model)["patches"]["attention_temperature"]
    hfpatch.patch(model, attention_temperature={"kind": "logn", "window": WINDOW})  # a window given: it applies
    assert hfpatch.describe(model)["attention_temperature"]["window"] == WINDOW


@pytest.mark.parametrize("failure", [ValueError("wrapped function differs"), KeyboardInterrupt()])
def test_a_failed_or_interrupted_patch_leaves_the_model_as_it_was(monkeypatch, failure):
    model = hfpatch.patch(tiny_model("llama"), position="alibi")
    ids = tokens(2 * WINDOW)
    before, prints, spec = logits(model, ids), fingerprint(model), hfpatch.describe(model)["applied"]
    probes = iter([False, True])

    def failing_probe(*args):  # the second probe forward, after the attention function was switched
        if next(probes):
            raise failure
        return torch.zeros(1)

    monkeypatch.setattr(temperature, "probe_logits", failing_probe)
    with pytest.raises(type(failure)):
        hfpatch.patch(model, attention_temperature="logn")
    monkeypatch.undo()
    assert max_diff(logits(model, ids), before) == 0.0
    assert_same_fingerprint(fingerprint(model), prints)
    assert hfpatch.describe(model)["applied"] == spec
    assert model.config._attn_implementation == "hfpatch_alibi"


def test_gguf_export_refuses_it():
    from hfpatch.interop.gguf import request

    with pytest.raises(ValueError, match="attention_temperature= has no GGUF form"):
        request(position="yarn", factor=4, attention_temperature="logn")


# ------------------------------------------------------------------------------------------------- command line

def test_command_line_patch_saves_a_model_that_reloads_with_it(tmp_path, capsys):
    src, out = tmp_path / "tiny", tmp_path / "out"
    hfpatch.save_pretrained(tiny_model("llama"), src)
    assert main(["patch", str(src), "--position", "yarn", "--factor", "4", "--attention-temperature",
                 "logn:window=32", "--out", str(out)]) == 0
    assert "yarn:4+attention_temperature=logn:window=32" in capsys.readouterr().out
    expected = hfpatch.patch(tiny_model("llama"), position="yarn", factor=4,
                             attention_temperature={"kind": "logn", "window": 32})
    ids = tokens(3 * WINDOW)
    assert max_diff(logits(hfpatch.from_pretrained(out), ids), logits(expected, ids)) == 0.0
    assert main(["describe", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["attention_temperature"] == {"kind": "logn", "window": 32}


@pytest.mark.parametrize("value,message", [("logm", "unknown attention_temperature 'logm'"),
                                           ("logn:4096", "expected key=value")])
def test_command_line_bad_temperature_is_one_line_and_exit_2(tmp_path, capsys, value, message):
    src = tmp_path / "tiny"
    hfpatch.save_pretrained(tiny_model("llama"), src)
    capsys.readouterr()
    assert main(["patch", str(src), "--attention-temperature", value, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1


def test_a_later_position_patch_keeps_the_temperature_on_top():
    """The temperature axis comes after position: a position patch made after it is applied under it again, so the
    model equals the two asked for in one call."""
    ids = tokens(3 * WINDOW)
    later = hfpatch.patch(tiny_model("llama"), attention_temperature="logn")
    hfpatch.patch(later, position="alibi")
    once = hfpatch.patch(tiny_model("llama"), position="alibi", attention_temperature="logn")
    assert later.config._attn_implementation == "hfpatch_temperature"
    assert max_diff(logits(later, ids), logits(once, ids)) == 0.0
    assert hfpatch.describe(later)["applied"] == hfpatch.describe(once)["applied"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tiny_family_it_applies_to_keeps_its_logits_inside_the_window_and_unpatches_exactly(family):
    """Up to floor_scale - 1 tokens the logits are the family's own, past it they change (learned tables end at
    WINDOW, so floor_scale is half of it here); unpatch gives the family's own back exactly."""
    model = tiny_model(family)
    if "llama4" not in hfpatch.supported(model)["patches"]["attention_temperature"]:
        pytest.skip(hfpatch.supported(model)["patches"]["not_available"]["attention_temperature=llama4"])
    floor_scale = WINDOW // 2
    short, long = tokens(floor_scale - 1), tokens(WINDOW)
    before_short, before_long = logits(model, short), logits(model, long)
    hfpatch.patch(model, attention_temperature={"kind": "llama4", "floor_scale": floor_scale, "attn_scale": 1.0})
    assert max_diff(logits(model, short), before_short) == 0.0
    assert max_diff(logits(model, long), before_long) > 0.0
    hfpatch.unpatch(model)
    assert max_diff(logits(model, long), before_long) == 0.0
