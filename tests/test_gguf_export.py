"""GGUF in, GGUF out (hfpatch.interop.gguf): llama.cpp's RoPE metadata for every scheme a GGUF can carry, the weights
byte for byte, the refusals, and the way back into transformers (hfpatch.models.load) as the patched model."""

from __future__ import annotations

import math
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import WINDOW, stdlib_text, tiny_model
from tiny_gguf import write_llama_gguf

import hfpatch
from hfpatch.cli import main
from hfpatch.interop import gguf as hg
from hfpatch.interop.gguf_file import write_copy
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


@pytest.mark.parametrize("options", [{}, {"group_size": 2}, {"window": 16}])
def test_self_extend_with_its_defaults_names_the_settings_patch_would_choose(options, tiny, tmp_path, capsys):
    """Options left out are the scheme's own defaults for the file's trained window, as hfpatch.patch chooses them
    (read off describe() of the model patched in memory), given as llama.cpp's flags; the CLI says so in one line."""
    model = tiny_model("llama")
    hfpatch.patch(model, position="self-extend", **options)
    chosen = hfpatch.describe(model)["position"]
    flags = f"--grp-attn-n {chosen['group_size']} --grp-attn-w {chosen['window']}"
    with pytest.raises(ValueError, match=flags) as e:
        hg.export(tiny[1], tmp_path / "out.gguf", position="self-extend", **options)
    assert f"{WINDOW}-token trained window" in str(e.value)
    assert not list(tmp_path.iterdir())
    opts = [a for k, v in options.items() for a in ("--opt", f"{k}={v}")]
    assert main(["patch", tiny[1], "--position", "self-extend", *opts, "--out", str(tmp_path / "se.gguf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flags in err[0]


def test_the_llama_cpp_engine_refuses_self_extend_with_its_defaults_by_name(tiny):
    """eval --engine llama.cpp --patches self-extend: the refusal with llama.cpp's flags (no KeyError)."""
    from hfpatch.evaluate.llamacpp import LlamaCppModel

    engine = LlamaCppModel(tiny[1], threads=1)
    try:
        with pytest.raises(ValueError, match=f"--grp-attn-n 4 --grp-attn-w {WINDOW // 8}") as e, \
                engine.applied({"position": "self-extend"}, "self-extend"):
            pass
        assert "patch spec 'self-extend' with --engine llama.cpp" in str(e.value)
    finally:
        engine.close()


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
    write_copy(gguf, reader, str(tmp_path / "bare.gguf"), {}, {hg.RECORD_KEY}, {}, set())
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
    write_copy(gguf, reader, str(tmp_path / "edited.gguf"), factor, set(), {}, set())
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


# ------------------------------------------------------------------------------- exporting from an exported file

def same_file_contents(a, b) -> None:
    """Metadata key by key, and every tensor (names, types, bytes), equal in two GGUF files."""
    assert fields(a) == fields(b)
    ta, tb = tensors(a), tensors(b)
    assert list(ta) == list(tb)
    for name, t in ta.items():
        assert tb[name].tensor_type == t.tensor_type and bytes(tb[name].data) == bytes(t.data), name


@pytest.mark.parametrize("first", ["ntk", "yarn", "linear", "llama3", "longrope", "yarn-window"])
@pytest.mark.parametrize("then", ["yarn", "rope", "ntk", "llama3", "longrope"])
def test_an_export_of_an_export_is_the_export_of_the_original(first, then, tiny, tmp_path):
    """The source's scaling is removed whole (NTK's raised base, scaling keys, the original window, rope_freqs and
    LongRoPE tensors) before the new scheme is written: no stacking."""
    hg.export(tiny[1], tmp_path / "first.gguf", **SPECS[first])
    hg.export(tmp_path / "first.gguf", tmp_path / "again.gguf", **SPECS[then])
    hg.export(tiny[1], tmp_path / "direct.gguf", **SPECS[then])
    same_file_contents(tmp_path / "again.gguf", tmp_path / "direct.gguf")


def test_smollm2_exported_again_from_its_ntk_export_runs_at_its_own_base(tmp_path):
    """SmolLM2 exported with ntk:2 (base 100,000 raised to about 204,522), then with yarn:2 and plain rope from that
    file: each is the export from the original GGUF, base 100,000 included."""
    from hfpatch.models import smollm2_path

    try:
        src = smollm2_path()
    except ValueError as e:
        pytest.skip(str(e))
    hg.export(src, tmp_path / "ntk.gguf", position="ntk", factor=2.0)
    assert fields(tmp_path / "ntk.gguf")["llama.rope.freq_base"] > 200_000
    for name, spec in {"yarn": {"position": "yarn", "factor": 2.0}, "rope": {"position": "rope"}}.items():
        hg.export(tmp_path / "ntk.gguf", tmp_path / f"ntk-{name}.gguf", **spec)
        hg.export(src, tmp_path / f"{name}.gguf", **spec)
        assert fields(tmp_path / f"ntk-{name}.gguf")["llama.rope.freq_base"] == 100_000.0
        assert fields(tmp_path / f"ntk-{name}.gguf") == fields(tmp_path / f"{name}.gguf")
        assert list(tensors(tmp_path / f"ntk-{name}.gguf")) == list(tensors(tmp_path / f"{name}.gguf"))
        (tmp_path / f"{name}.gguf").unlink()  # 100 MB each


def without_record(path, out) -> str:
    """`path` as another tool would have written it: the same metadata, no hfpatch record."""
    write_copy(gguf, gguf.GGUFReader(str(path)), str(out), {}, {hg.RECORD_KEY}, {}, set())
    return str(out)


@pytest.mark.parametrize("first, says", [("ntk", "context_length=128 over rope.scaling.original_context_length=64"),
                                          ("yarn", "rope.scaling.type=yarn"),
                                          ("llama3", "rope_freqs.weight")])
def test_a_scaling_made_elsewhere_is_replaced_with_a_warning_that_the_base_is_kept(first, says, tiny, tmp_path):
    hg.export(tiny[1], tmp_path / "rec.gguf", **SPECS[first])
    bare = without_record(tmp_path / "rec.gguf", tmp_path / "bare.gguf")
    base = fields(bare)["llama.rope.freq_base"]
    with pytest.warns(UserWarning, match="did not export") as w:
        hg.export(bare, tmp_path / "out.gguf", position="yarn", factor=2.0)
    message = str(w[0].message)
    assert says in message and f"rope.freq_base = {base:g}" in message
    assert fields(tmp_path / "out.gguf")["llama.rope.freq_base"] == base  # kept, as the warning says
    assert "rope_freqs.weight" not in tensors(tmp_path / "out.gguf")  # the scaling itself is still replaced


def test_an_unscaled_source_or_an_hfpatch_export_gives_no_warning(tiny, tmp_path, recwarn):
    hg.export(tiny[1], tmp_path / "a.gguf", position="ntk", factor=2.0)
    hg.export(tmp_path / "a.gguf", tmp_path / "b.gguf", position="yarn", factor=2.0)
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]


def test_cli_prints_the_kept_base_warning_in_one_line(tiny, tmp_path, capsys):
    hg.export(tiny[1], tmp_path / "rec.gguf", position="yarn", factor=4.0)
    bare = without_record(tmp_path / "rec.gguf", tmp_path / "bare.gguf")
    assert main(["patch", bare, "--position", "rope", "--out", str(tmp_path / "out.gguf")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hfpatch: warning: ") and "did not export" in err[0]


# ------------------------------------------------------------------------------------------------ read_patch cache

def test_read_patch_sees_a_file_copied_over_with_its_times_kept(tiny, tmp_path):
    """Two exports of the same size (the factor's digits have the same length) and the same mtime (as two files
    copied with their times kept): once `b` was read, `a` copied over it with cp -p has b's path, size and mtime; the
    next read is of the new content, not the cached old one."""
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    hg.export(tiny[1], a, position="yarn", factor=2.0)
    hg.export(tiny[1], b, position="yarn", factor=3.0)
    os.utime(b, ns=(a.stat().st_atime_ns, a.stat().st_mtime_ns))
    assert a.stat().st_size == b.stat().st_size
    assert hg.read_patch(b).patch["factor"] == 3.0
    shutil.copy2(a, b)  # cp -p: a's content and times, written into b's inode
    assert (b.stat().st_size, b.stat().st_mtime_ns) == (a.stat().st_size, a.stat().st_mtime_ns)
    assert hg.read_patch(b).patch["factor"] == 2.0
