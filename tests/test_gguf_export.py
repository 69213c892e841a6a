"""GGUF in, GGUF out (hfpatch.gguf): llama.cpp's RoPE metadata for every scheme a GGUF can carry, the weights
byte for byte, the refusals, and the way back into transformers (hfpatch.models.load) as the patched model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import WINDOW, stdlib_text, tiny_model
from tiny_gguf import write_llama_gguf

import hfpatch
from hfpatch import gguf as hg
from hfpatch.cli import main
from hfpatch.models import load

gguf = pytest.importorskip("gguf", reason="GGUF export needs the gguf package (pip install 'hfpatch[gguf]')")

HEAD = 16  # the tiny llama's head_dim: 8 rotary frequencies
SPECS = {
    "rope": {"position": "rope"},
    "linear": {"position": "linear", "factor": 2.0},
    "ntk": {"position": "ntk", "factor": 2.0},
    "yarn": {"position": "yarn", "factor": 4.0},
    "yarn-attention": {"position": "yarn", "factor": 3.0, "attention_factor": 1.3},
    "yarn-window": {"position": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn-mscale": {"position": "yarn", "factor": 4.0, "mscale": 0.8, "mscale_all_dim": 0.6},
    "llama3": {"position": "llama3", "factor": 4.0},
    "llama3-window": {"position": "llama3", "factor": 8.0, "original_max_position_embeddings": 256},
    "longrope": {"position": "longrope", "factor": 4.0, "short_factor": [1.0 + i / 20 for i in range(8)],
                 "long_factor": [1.0 + i / 4 for i in range(8)]},
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the tiny random llama, its GGUF file)."""
    model = tiny_model("llama")
    path = write_llama_gguf(model, tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return model, path


@pytest.fixture(scope="module")
def loaded(tiny):
    model, _ = load(tiny[1], tokenizer=False)
    return model.eval()


def fields(path) -> dict:
    r = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def tensors(path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def logits(model, n=150, seed=0):
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


def test_the_tiny_gguf_is_the_tiny_model(tiny, loaded):
    """The test file itself: transformers' GGUF loader gives back the model it was written from."""
    assert torch.equal(logits(tiny[0]), logits(loaded))


@pytest.mark.parametrize("name", list(SPECS))
def test_metadata_carries_what_the_in_memory_patch_computes(name, tiny, tmp_path):
    model, src = tiny
    spec = SPECS[name]
    written = hg.export(src, tmp_path / "out.gguf", **spec)
    meta, rope_tensors = fields(tmp_path / "out.gguf"), tensors(tmp_path / "out.gguf")
    plain_inv = model.model.rotary_emb.inv_freq.double().clone()
    hfpatch.patch(model, **spec)
    try:
        rotary, config = model.model.rotary_emb, model.config
        window = spec.get("original_max_position_embeddings", WINDOW)
        assert meta["llama.context_length"] == config.max_position_embeddings
        assert meta["llama.rope.scaling.original_context_length"] == window
        scaling = meta["llama.rope.scaling.type"]
        assert scaling == {"rope": "none", "linear": "linear", "ntk": "none", "yarn": "yarn", "llama3": "none",
                           "longrope": "longrope"}[spec["position"]]
        base = meta["llama.rope.freq_base"]
        assert base == pytest.approx(config.rope_parameters["rope_theta"], rel=1e-7)
        if spec["position"] == "ntk":  # bloc97's base change, by hand
            assert base == pytest.approx(10000.0 * 2.0 ** (HEAD / (HEAD - 2)), rel=1e-7)
        if scaling == "linear":
            assert meta["llama.rope.scaling.factor"] == spec["factor"]
            assert torch.allclose(rotary.inv_freq.double(), plain_inv / spec["factor"], rtol=1e-6)
        if scaling == "yarn":
            # llama.cpp multiplies the angles by attn_factor * (1 + 0.1 ln s)
            assert meta["llama.rope.scaling.attn_factor"] * (1 + 0.1 * math.log(spec["factor"])) == \
                pytest.approx(rotary.attention_scaling, rel=1e-6)
            assert meta["llama.rope.scaling.factor"] == spec["factor"]
            assert (meta["llama.rope.scaling.yarn_beta_fast"], meta["llama.rope.scaling.yarn_beta_slow"]) == (32, 1)
            if name == "yarn":  # the paper's default attention factor is llama.cpp's own: nothing to add
                assert meta["llama.rope.scaling.attn_factor"] == 1.0
        if spec["position"] == "llama3":
            freqs = rope_tensors["rope_freqs.weight"].data.astype(np.float64)
            assert np.allclose(freqs, (plain_inv / rotary.inv_freq.double()).numpy(), rtol=1e-6)
            assert np.allclose(freqs, llama3_divisors(plain_inv.numpy(), spec["factor"], window), rtol=1e-5)
            assert "llama.rope.scaling.factor" not in meta
        else:
            assert "rope_freqs.weight" not in rope_tensors
        if scaling == "longrope":
            assert np.array_equal(rope_tensors["rope_factors_long.weight"].data, np.float32(spec["long_factor"]))
            assert np.array_equal(rope_tensors["rope_factors_short.weight"].data, np.float32(spec["short_factor"]))
            assert meta["llama.rope.scaling.attn_factor"] == pytest.approx(rotary.attention_scaling, rel=1e-6)
            # Phi-3's default: sqrt(1 + ln s / ln L)
            assert rotary.attention_scaling == pytest.approx(math.sqrt(1 + math.log(4) / math.log(WINDOW)))
            assert "llama.rope.scaling.factor" not in meta  # llama.cpp would divide the angles by it once more
        assert written["context_length"] == config.max_position_embeddings
    finally:
        hfpatch.unpatch(model)


def llama3_divisors(inv_freq, factor, window, low=1.0, high=4.0):
    """Llama 3.1's frequency-dependent scaling written out (Meta's reference code), as divisors of each angle."""
    out = []
    for f in inv_freq:
        wavelen = 2 * math.pi / f
        if wavelen < window / high:
            out.append(1.0)
        elif wavelen > window / low:
            out.append(factor)
        else:
            smooth = (window / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


def test_weights_and_other_metadata_are_copied_unchanged(tiny, tmp_path):
    _, src = tiny
    hg.export(src, tmp_path / "out.gguf", position="llama3", factor=4.0)
    a, b = tensors(src), tensors(tmp_path / "out.gguf")
    assert set(b) == set(a) | {"rope_freqs.weight"}
    for name, t in a.items():
        assert b[name].tensor_type == t.tensor_type and list(b[name].shape) == list(t.shape)
        assert bytes(b[name].data) == bytes(t.data), name
    fa, fb = fields(src), fields(tmp_path / "out.gguf")
    rewritten = {"llama.context_length", "llama.rope.scaling.original_context_length", "llama.rope.scaling.type",
                 hg.RECORD_KEY}
    assert set(fb) == set(fa) | rewritten
    assert {k: v for k, v in fa.items() if k not in rewritten} == {k: v for k, v in fb.items() if k not in rewritten}


def test_a_new_scheme_replaces_the_sources_scaling(tiny, tmp_path):
    """A GGUF that already carries llama3 scaling, exported with yarn: its rope_freqs tensor goes (llama.cpp would
    apply it on top of YaRN), and the file reads back as yarn alone."""
    _, src = tiny
    hg.export(src, tmp_path / "llama3.gguf", position="llama3", factor=4.0)
    hg.export(tmp_path / "llama3.gguf", tmp_path / "yarn.gguf", position="yarn", factor=2.0)
    assert "rope_freqs.weight" not in tensors(tmp_path / "yarn.gguf")
    found = hg.read_patch(tmp_path / "yarn.gguf")
    assert found.patch == {"position": "yarn", "factor": 2.0} and found.window == WINDOW


REFUSALS = {
    "dynamic": ({"position": "dynamic"}, "fixed when the context is created"),
    "dynamic-yarn": ({"position": "dynamic-yarn"}, "fixed when the context is created"),
    "alibi": ({"position": "alibi"}, "never from metadata"),
    "nope": ({"position": "nope"}, "reads from no metadata"),
    "t5": ({"position": "t5"}, "reads from no metadata"),
    "xl": ({"position": "xl"}, "reads from no metadata"),
    "sinusoidal": ({"position": "sinusoidal"}, "reads from no metadata"),
    "learned": ({"position": "learned"}, "reads from no metadata"),
    "interpolate": ({"position": "interpolate", "factor": 2.0}, "reads from no metadata"),
    "self-extend": ({"position": "self-extend", "group_size": 4, "window": 512},
                    "--grp-attn-n 4 --grp-attn-w 512"),
    "norm": ({"norm": "layernorm"}, "norm= changes the model's blocks"),
    "placement": ({"placement": "post"}, "placement= changes"),
    "yarn-betas": ({"position": "yarn", "factor": 4.0, "beta_fast": 16.0}, "does not read YaRN's betas"),
    "yarn-truncate": ({"position": "yarn", "factor": 4.0, "truncate": False}, "truncate=True"),
    "layer-types": ({"position": "yarn", "factor": 4.0, "layer_types": ["full_attention"]}, "layer_types="),
    "longrope-length": ({"position": "longrope", "factor": 2.0, "short_factor": [1.0] * 4, "long_factor": [1.0] * 4},
                        "one entry per rotary frequency: 8"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_what_llama_cpp_cannot_express_is_refused_with_the_reason(name, tiny, tmp_path):
    spec, reason = REFUSALS[name]
    with pytest.raises(ValueError) as e:
        hg.export(tiny[1], tmp_path / "out.gguf", **spec)
    assert reason in str(e.value)
    assert not list(tmp_path.iterdir())  # nothing written, not even a partial file


def test_self_extend_names_a_width_llama_cpp_accepts(tiny, tmp_path):
    with pytest.raises(ValueError) as e:
        hg.export(tiny[1], tmp_path / "out.gguf", position="self-extend", group_size=3, window=512)
    assert "--grp-attn-n 3 --grp-attn-w 510" in str(e.value) and "llama-server" in str(e.value)


def test_yarn_betas_go_into_the_file_of_an_architecture_that_reads_them(tmp_path):
    info = hg.RopeInfo("mistral3", 1e4, 64, 64, 16)
    p = hg.plan(info, hfpatch.spec.request(position="yarn", factor=4.0, beta_fast=16.0)["position"])
    assert p.keys["rope.scaling.yarn_beta_fast"] == (16.0, "f32")


def test_cli_writes_the_gguf_and_refuses_in_one_line(tiny, tmp_path, capsys):
    out = tmp_path / "out.gguf"
    assert main(["patch", tiny[1], "--position", "yarn", "--factor", "4", "--out", str(out)]) == 0
    assert "yarn:4" in capsys.readouterr().out and fields(out)["llama.rope.scaling.type"] == "yarn"
    assert main(["patch", tiny[1], "--position", "self-extend", "--opt", "group_size=4", "--opt", "window=32",
                 "--out", str(tmp_path / "se.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--grp-attn-n 4 --grp-attn-w 32" in err
    assert main(["patch", tiny[1], "--position", "yarn", "--factor", "4", "--dtype", "float32", "--out",
                 str(tmp_path / "d.gguf")]) == 2
    assert "--dtype does not apply" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(SPECS))
def test_the_exported_file_loads_as_the_patched_model(name, tiny, loaded, tmp_path):
    """hfpatch.models.load of the exported file = the original file loaded and patched in memory: the same spec,
    the same logits, and unpatch gives the original back."""
    spec = SPECS[name]
    hg.export(tiny[1], tmp_path / "out.gguf", **spec)
    model, _ = load(str(tmp_path / "out.gguf"), tokenizer=False)
    hfpatch.patch(loaded, **spec)
    try:
        assert hfpatch.describe(model)["applied"] == hfpatch.describe(loaded)["applied"] == \
            hfpatch.spec.request(**spec)
        assert model.config.max_position_embeddings == loaded.config.max_position_embeddings
        assert torch.equal(logits(model.eval()), logits(loaded))
    finally:
        hfpatch.unpatch(loaded)
    hfpatch.unpatch(model)
    assert torch.equal(logits(model), logits(loaded))


@pytest.mark.parametrize("name", ["yarn", "yarn-attention", "linear", "llama3", "longrope"])
def test_a_gguf_made_elsewhere_is_read_from_llama_cpp_metadata(name, tiny, loaded, tmp_path):
    """Without hfpatch's record (a file from llama.cpp's converter), the scheme is read from the metadata llama.cpp
    reads, and gives the same model up to the metadata's float32 rounding."""
    spec = SPECS[name]
    hg.export(tiny[1], tmp_path / "rec.gguf", **spec)
    reader = gguf.GGUFReader(str(tmp_path / "rec.gguf"))
    hg._write(gguf, reader, str(tmp_path / "bare.gguf"), {}, {hg.RECORD_KEY}, {}, set())
    found = hg.read_patch(tmp_path / "bare.gguf")
    assert found.source == "metadata" and found.patch["position"] == spec["position"]
    model, _ = load(str(tmp_path / "bare.gguf"), tokenizer=False)
    hfpatch.patch(loaded, **spec)
    try:
        assert torch.allclose(logits(model.eval()), logits(loaded), atol=1e-5, rtol=0)
    finally:
        hfpatch.unpatch(loaded)


def test_metadata_edited_after_export_wins_over_the_record(tiny, tmp_path):
    hg.export(tiny[1], tmp_path / "rec.gguf", position="yarn", factor=4.0)
    reader = gguf.GGUFReader(str(tmp_path / "rec.gguf"))
    factor = {"llama.rope.scaling.factor": (2.0, "f32"), "llama.context_length": (128, "u32")}
    hg._write(gguf, reader, str(tmp_path / "edited.gguf"), factor, set(), {}, set())
    with pytest.warns(UserWarning, match="no longer matches the hfpatch record"):
        found = hg.read_patch(tmp_path / "edited.gguf")
    assert found.patch["factor"] == 2.0 and found.source == "metadata"


def test_an_unscaled_gguf_loads_as_before(tiny):
    assert hg.read_patch(tiny[1]) is None


def test_smollm2_exported_with_yarn_comes_back_as_yarn(smollm2, tmp_path):
    """The real model: the exported GGUF, loaded by hfpatch, is SmolLM2 with yarn:4 (described so, and the same
    logits over 300 tokens of real text as the embedded GGUF patched in memory)."""
    from hfpatch.models import smollm2_path

    model, tok = smollm2
    out = tmp_path / "smollm2-yarn4.gguf"
    hg.export(smollm2_path(), out, position="yarn", factor=4.0)
    exported, _ = load(str(out), tokenizer=False)
    info = hfpatch.describe(exported)
    assert info["applied"] == {"position": {"scheme": "yarn", "factor": 4.0}}
    assert info["max_position_embeddings"] == 4 * 8192
    ids = tok(stdlib_text(20_000), return_tensors="pt")["input_ids"][:, :300]
    hfpatch.patch(model, position="yarn", factor=4.0)
    try:
        with torch.no_grad():
            assert torch.equal(exported.eval()(ids).logits, model(ids).logits)
    finally:
        hfpatch.unpatch(model)
