"""GGUF export when the output or the input is not what it should be: each case is one error that says what was
wrong (one line and exit code 2 from the command), and nothing is written: no partial file, and whatever was at the
output path before is still there, byte for byte."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from conftest import tiny_model
from tiny_gguf import write_llama_gguf

from hfpatch.cli import main
from hfpatch.interop import gguf as hg

gguf = pytest.importorskip("gguf", reason="GGUF export needs the gguf package (pip install 'hfpatch[gguf]')")

YARN = {"position": "yarn", "factor": 2.0}


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> str:
    return write_llama_gguf(tiny_model("llama"), tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture
def folder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    return out


def snapshot(folder) -> dict:
    """{name: bytes} of everything in the folder (a leftover temporary file shows up here)."""
    return {p.name: (p.read_bytes() if p.is_file() else "folder") for p in sorted(folder.iterdir())}


def cli(src, out, *extra) -> int:
    return main(["patch", str(src), "--position", "yarn", "--factor", "2", "--out", str(out), *extra])


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_folder_named_like_the_output_is_refused_before_any_work(src, folder, capsys, monkeypatch):
    (folder / "x.gguf").mkdir()
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: pytest.fail("the source was read"))
    with pytest.raises(ValueError, match="is a folder"):
        hg.export(src, folder / "x.gguf", **YARN)
    assert cli(src, folder / "x.gguf") == 2
    assert "is a folder" in one_line(capsys)
    assert snapshot(folder) == {"x.gguf": "folder"} and not list((folder / "x.gguf").iterdir())


def test_an_existing_output_is_kept_unless_overwrite_is_given(src, folder, capsys):
    out = folder / "x.gguf"
    hg.export(src, out, position="linear", factor=2.0)
    before = snapshot(folder)
    with pytest.raises(ValueError, match="exists; give overwrite=True"):
        hg.export(src, out, **YARN)
    assert cli(src, out) == 2
    assert "--overwrite" in one_line(capsys)
    assert snapshot(folder) == before
    assert cli(src, out, "--overwrite") == 0
    assert hg.read_patch(out).patch == {"position": "yarn", "factor": 2.0}
    assert snapshot(folder).keys() == before.keys()


@pytest.mark.parametrize("content", [b"", b"my notes\n", b"GGU"])
def test_a_file_that_is_not_a_gguf_is_never_overwritten(content, src, folder, capsys):
    out = folder / "x.gguf"
    out.write_bytes(content)
    with pytest.raises(ValueError, match="not a GGUF file; it is never overwritten"):
        hg.export(src, out, overwrite=True, **YARN)
    assert cli(src, out, "--overwrite") == 2
    assert "not a GGUF file" in one_line(capsys)
    assert out.read_bytes() == content and snapshot(folder) == {"x.gguf": content}


def fail_after(monkeypatch, method: str, calls: int, error: OSError) -> None:
    """GGUFWriter.`method` raises `error` at its call number `calls` + 1 (the earlier ones run: a write half done)."""
    original = getattr(gguf.GGUFWriter, method)
    count = [0]

    def failing(self, *args, **kwargs):
        count[0] += 1
        if count[0] > calls:
            raise error
        return original(self, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, method, failing)


def test_a_full_disk_mid_write_leaves_the_old_output_and_no_partial_file(src, folder, capsys, monkeypatch):
    out = folder / "x.gguf"
    hg.export(src, out, position="linear", factor=2.0)
    before = snapshot(folder)
    fail_after(monkeypatch, "write_tensor_data", 3, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    with pytest.raises(ValueError, match=f"could not write {out}: no space left on the device"):
        hg.export(src, out, overwrite=True, **YARN)
    assert cli(src, out, "--overwrite") == 2
    assert "no space left" in one_line(capsys)
    assert snapshot(folder) == before


def test_a_read_only_folder_is_one_error_and_leaves_nothing(src, folder, capsys, monkeypatch):
    os.chmod(folder, 0o555)
    try:
        if os.access(folder, os.W_OK):  # root writes anyway: the file system's refusal, injected where it comes
            fail_after(monkeypatch, "open_output_file", 0,
                       OSError(errno.EROFS, os.strerror(errno.EROFS), str(folder / "x.gguf.tmp")))
        with pytest.raises(ValueError, match=f"could not write {folder / 'x.gguf'}: (Read-only|Permission)"):
            hg.export(src, folder / "x.gguf", **YARN)
        assert cli(src, folder / "x.gguf") == 2
        assert "could not write" in one_line(capsys)
        assert snapshot(folder) == {}
    finally:
        os.chmod(folder, 0o755)


def test_an_interrupt_mid_write_leaves_no_partial_file(src, folder, monkeypatch):
    fail_after(monkeypatch, "write_tensor_data", 2, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        hg.export(src, folder / "x.gguf", **YARN)
    assert snapshot(folder) == {}


@pytest.mark.parametrize("damage", ["truncated", "header only", "garbage", "empty"])
def test_a_damaged_source_is_one_error_with_its_size(damage, src, tmp_path, folder, capsys):
    data = Path(src).read_bytes()
    content = {"truncated": data[: len(data) // 2], "header only": data[:4000], "empty": b"",
               "garbage": bytes(range(256)) * 40}[damage]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    message = f"{bad} is not a readable GGUF file (truncated or damaged?): {len(content):,} bytes"
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        hg.export(bad, folder / "x.gguf", **YARN)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        hg.read_patch(bad)
    assert cli(bad, folder / "x.gguf") == 2
    assert message in one_line(capsys)
    assert snapshot(folder) == {}
