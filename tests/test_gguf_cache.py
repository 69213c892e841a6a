"""The GGUF cache (hfpatch.interop.gguf_cache): a GGUF file is converted once, and a later load reads the conversion
from the cache folder: the same weights, config and logits as a load from the file, in any dtype, with the RoPE the
file carries; never a half-written or damaged entry; a cache that cannot be written is one warning; and it can be
turned off. Each test has its own cache folder ($HFPATCH_CACHE)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import tiny_model, tokens
from tiny_gguf import write_llama_gguf

import hfpatch
from hfpatch.interop import gguf as hg
from hfpatch.interop import gguf_cache, gguf_file
from hfpatch.models import load
from hfpatch.utils.files import cache_dir

gguf = pytest.importorskip("gguf", reason="GGUF files need the gguf package (pip install 'hfpatch[gguf]')")


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> str:
    return write_llama_gguf(tiny_model("llama"), tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """A cache folder of this test's own, the cache on, and the process's one warning not yet given."""
    monkeypatch.setenv("HFPATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(gguf_cache.ENV, raising=False)
    monkeypatch.setattr(gguf_cache, "_warned", False)
    return tmp_path / "cache"


def from_file(name, monkeypatch, **kwargs):
    """The load without the cache: the file converted by transformers' GGUF loader, as before there was one."""
    with monkeypatch.context() as m:
        m.setenv(gguf_cache.ENV, "off")
        return load(name, tokenizer=False, **kwargs)[0]


def assert_same_model(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)
    ca, cb = a.config.to_dict(), b.config.to_dict()
    for config in (ca, cb):  # transformers' GGUF quantizer, which a load from the cache does not attach
        config.pop("quantization_config", None)
    assert ca == cb
    assert a.generation_config.to_dict() == b.generation_config.to_dict()
    assert hfpatch.describe(a) == hfpatch.describe(b)
    ids = tokens(40)
    with torch.no_grad():
        assert torch.equal(a.eval()(ids).logits, b.eval()(ids).logits)


def no_gguf_reading(monkeypatch) -> None:
    """From here on, opening a GGUF file fails the test."""
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: pytest.fail("the GGUF file was read"))
    hg._read_patch.cache_clear()


def parts(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "gguf").glob("*/*"))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_a_load_from_the_cache_is_the_load_from_the_file(src, cache, monkeypatch, dtype):
    plain = from_file(src, monkeypatch, dtype=dtype)
    assert not (cache / "gguf").exists()
    first = load(src, tokenizer=False, dtype=dtype)[0]  # converts, writes the cache, loads from it
    assert parts(cache) == ["model", "rope.json"]
    no_gguf_reading(monkeypatch)
    again = load(src, tokenizer=False, dtype=dtype)[0]
    assert_same_model(plain, first)
    assert_same_model(plain, again)
    assert again.dtype == (dtype or torch.float32) and again.name_or_path == plain.name_or_path


def test_the_rope_a_gguf_file_carries_comes_back_from_the_cache(src, tmp_path, monkeypatch):
    exported = tmp_path / "yarn.gguf"
    hg.export(src, exported, position="yarn", factor=4.0, attention_factor=1.2)
    plain = from_file(exported, monkeypatch)
    load(exported, tokenizer=False)
    no_gguf_reading(monkeypatch)
    cached = load(exported, tokenizer=False)[0]
    assert hfpatch.describe(cached)["loaded_with"].startswith("yarn:4")
    assert_same_model(plain, cached)


@pytest.mark.parametrize("record", ["damaged", "of other reading code"])
def test_a_rope_record_that_cannot_be_used_is_read_from_the_file_again(src, tmp_path, cache, monkeypatch, record):
    exported = tmp_path / "yarn.gguf"
    hg.export(src, exported, position="yarn", factor=4.0)
    load(exported, tokenizer=False)
    (rope,) = (cache / "gguf").glob("*/rope.json")
    text = rope.read_text()
    rope.write_text(text[:len(text) // 2] if record == "damaged" else text.replace('"source": "', '"source": "0'))
    reads = []
    real = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: reads.append(a) or real(*a, **k))
    hg._read_patch.cache_clear()
    cached = load(exported, tokenizer=False)[0]
    assert len(reads) == 1 and hfpatch.describe(cached)["loaded_with"].startswith("yarn:4")
    assert rope.read_text() == text  # written again


def without_record(path: Path, out: Path) -> Path:
    """A copy of an exported file without hfpatch's record: read from llama.cpp's metadata alone."""
    reader = gguf.GGUFReader(str(path))
    gguf_file.write_copy(gguf, reader, str(out), {}, {hg.RECORD_KEY}, {}, set())
    return out


def test_reading_the_rope_runs_only_the_modules_its_record_is_keyed_by(src, tmp_path):
    """rope.json is read again when one of ROPE_READING changes: reading the RoPE of a file (plain, with hfpatch's
    record, from llama.cpp's metadata alone, with per-frequency tensors) runs code of no other hfpatch module."""
    root = Path(hfpatch.__file__).parent
    ran: set[str] = set()

    def record(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(str(root)):
            ran.add(Path(frame.f_code.co_filename).relative_to(root).as_posix())

    specs = {"yarn": {"position": "yarn", "factor": 4.0}, "llama3": {"position": "llama3", "factor": 8.0},
             "longrope": {"position": "longrope", "factor": 4.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}
    files = [Path(src)]
    for name, spec in specs.items():
        hg.export(src, tmp_path / f"{name}.gguf", **spec)
        files += [tmp_path / f"{name}.gguf", without_record(tmp_path / f"{name}.gguf", tmp_path / f"{name}-bare.gguf")]
    found = []
    for path in files:
        hg._read_patch.cache_clear()
        sys.setprofile(record)
        try:
            found.append(hg.read_patch(path))
        finally:
            sys.setprofile(None)
    assert [f.source if f else None for f in found] == [None] + ["record", "metadata"] * 3
    assert ran <= set(gguf_cache.ROPE_READING), sorted(ran - set(gguf_cache.ROPE_READING))


def test_a_changed_file_is_converted_again(src, tmp_path, cache, monkeypatch):
    """The key is the file's content: the same path with other content is another entry, never the old one."""
    path = tmp_path / "m.gguf"
    hg.export(src, path, position="linear", factor=2.0)
    load(path, tokenizer=False)
    hg.export(src, path, position="yarn", factor=4.0, overwrite=True)
    cached = load(path, tokenizer=False)[0]
    assert hfpatch.describe(cached)["loaded_with"].startswith("yarn:4")
    assert_same_model(from_file(path, monkeypatch), cached)
    assert len(list((cache / "gguf").iterdir())) == 2


def largest_shard(cache: Path) -> Path:
    return max((cache / "gguf").glob("*/model/*.safetensors"), key=lambda p: p.stat().st_size)


def flip_a_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


DAMAGE = {
    "a flipped byte": lambda cache: flip_a_byte(largest_shard(cache)),
    "a truncated shard": lambda cache: os.truncate(largest_shard(cache), largest_shard(cache).stat().st_size // 2),
    "a deleted shard": lambda cache: largest_shard(cache).unlink(),
    "no manifest": lambda cache: next((cache / "gguf").glob("*/model/manifest.json")).unlink(),
    "a damaged manifest": lambda cache: next((cache / "gguf").glob("*/model/manifest.json")).write_text("{"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_entry_is_converted_again_never_loaded(src, cache, monkeypatch, damage):
    plain = from_file(src, monkeypatch)
    load(src, tokenizer=False)
    DAMAGE[damage](cache)
    converted = []
    real = gguf_cache.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(gguf_cache.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: converted.append(k.get("gguf_file")) or real(*a, **k))
    assert_same_model(plain, load(src, tokenizer=False)[0])
    assert converted == ["tiny.gguf", None]  # converted from the file again, then loaded from the new entry
    assert gguf_cache._verified(next((cache / "gguf").glob("*/model")))


# Loads the tiny GGUF with the cache, killed (SIGKILL) once the part's files are written and before it is renamed
# into place: the worst moment to die.
KILLED = r"""
import os, signal, sys
from hfpatch.interop import gguf_cache
from hfpatch.models import load
gguf_cache._finish = lambda tmp, part: os.kill(os.getpid(), signal.SIGKILL)
load(sys.argv[1], tokenizer=False)
"""


def test_a_process_killed_while_writing_leaves_nothing_that_loads(src, cache, monkeypatch):
    done = subprocess.run([sys.executable, "-c", KILLED, src], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HFPATCH_CACHE": str(cache)})
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    (entry,) = (cache / "gguf").iterdir()
    (left,) = entry.iterdir()  # its temporary folder, with every file but the manifest
    assert left.name.endswith(".partial") and any(left.glob("*.safetensors"))
    assert not (entry / "model").exists()
    assert_same_model(from_file(src, monkeypatch), load(src, tokenizer=False)[0])
    assert sorted(p.name for p in entry.iterdir()) == ["model", "rope.json"]  # the dead process's folder removed


def test_an_interrupted_write_leaves_no_temporary_folder(src, cache, monkeypatch):
    monkeypatch.setattr(gguf_cache, "_finish", lambda tmp, part: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        load(src, tokenizer=False)
    assert [p.name for p in (cache / "gguf").glob("*/*")] == []


def test_a_cache_folder_that_cannot_be_created_is_one_warning(src, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("HFPATCH_CACHE", str(blocker / "cache"))
    plain = from_file(src, monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = load(src, tokenizer=False)[0]
        second = load(src, tokenizer=False)[0]
    messages = [str(w.message) for w in caught if "GGUF cache" in str(w.message)]
    assert len(messages) == 1 and "cannot be written" in messages[0], messages
    assert_same_model(plain, first)
    assert_same_model(plain, second)


@pytest.mark.parametrize("how", ["OSError", "SafetensorError"])
def test_a_full_disk_is_one_warning_and_the_converted_model(src, cache, monkeypatch, how):
    from safetensors import SafetensorError

    full = OSError(28, os.strerror(28)) if how == "OSError" else \
        SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    def write(model, folder):
        (folder / "model.safetensors").write_bytes(b"half")
        raise full

    monkeypatch.setattr(gguf_cache, "_save_model", write)
    plain = from_file(src, monkeypatch)
    with pytest.warns(UserWarning, match="no space left on the device"):
        cached = load(src, tokenizer=False)[0]
    assert_same_model(plain, cached)
    assert [p.name for p in (cache / "gguf").glob("*/*")] == []  # nothing half written stays


def test_a_disk_the_conversion_would_fill_is_refused_as_full(src, cache, monkeypatch):
    """Less free space than the weights and a spare gigabyte: nothing written, one warning, the converted model."""
    real = shutil.disk_usage
    monkeypatch.setattr(gguf_cache.shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 20))
    with pytest.warns(UserWarning, match="no space left on the device"):
        cached = load(src, tokenizer=False)[0]
    assert_same_model(from_file(src, monkeypatch), cached)
    assert [p.name for p in (cache / "gguf").glob("*/*")] == []


def test_a_conversion_that_keeps_packed_gguf_weights_is_not_cached(src, cache, monkeypatch):
    """With transformers' GGUF kernels, the loader keeps quantized weights packed in its own modules: such a model is
    the file's own load, and nothing is written (a float copy would not be the same model)."""
    real = gguf_cache.AutoModelForCausalLM.from_pretrained

    def packed(*args, **kwargs):
        model = real(*args, **kwargs)
        if kwargs.get("gguf_file"):
            model.model.layers[0].mlp.add_module("packed", type("GgufLinear", (torch.nn.Module,), {})())
        return model

    monkeypatch.setattr(gguf_cache.AutoModelForCausalLM, "from_pretrained", packed)
    model = load(src, tokenizer=False)[0]
    assert type(model.model.layers[0].mlp.packed).__name__ == "GgufLinear"
    assert [p.name for p in (cache / "gguf").glob("*/*")] == []


def test_the_cache_can_be_turned_off(src, cache, monkeypatch):
    monkeypatch.setenv(gguf_cache.ENV, "off")
    load(src, tokenizer=False)
    assert not (cache / "gguf").exists()


def test_the_cache_folder_follows_the_xdg_convention(tmp_path, monkeypatch):
    monkeypatch.delenv("HFPATCH_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "hfpatch"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # not absolute: ignored, as the convention says
    assert cache_dir() == Path.home() / ".cache" / "hfpatch"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "hfpatch"
    monkeypatch.setenv("HFPATCH_CACHE", "~/elsewhere")
    assert cache_dir() == Path.home() / "elsewhere"


@pytest.mark.slow
def test_smollm2_from_the_cache_is_smollm2_from_its_gguf_file(smollm2_gguf, cache, monkeypatch):
    """The embedded default model: weights, logits and tokenizer from the cache equal the GGUF file's own load."""
    from hfpatch.models import SMOLLM2

    with monkeypatch.context() as m:
        m.setenv(gguf_cache.ENV, "off")
        plain, plain_tok = load(SMOLLM2)
    load(SMOLLM2)  # converts and caches the model and the tokenizer
    no_gguf_reading(monkeypatch)
    cached, tok = load(SMOLLM2)
    assert_same_model(plain, cached)
    text = Path(hg.__file__).read_text() + "\n<|im_start|>user ünïcödé 日本語 🙂<|im_end|>"
    assert tok(text)["input_ids"] == plain_tok(text)["input_ids"]
    assert tok.backend_tokenizer.to_str() == plain_tok.backend_tokenizer.to_str()
    assert (type(tok), tok.all_special_tokens, tok.chat_template, tok.name_or_path) == \
        (type(plain_tok), plain_tok.all_special_tokens, plain_tok.chat_template, plain_tok.name_or_path)
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, tokenize=False) == plain_tok.apply_chat_template(chat, tokenize=False)
