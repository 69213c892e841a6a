"""One atomic file writer: every file hfpatch writes where a reader or a killed run could see it half-written goes
through hfpatch.utils.files.write_file (a temporary file beside it, synced, renamed; removed on any failure; a
failure of the disk one OSError naming the file)."""

from __future__ import annotations

import ast
import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors import SafetensorError

from hfpatch.lm import text as lm_text
from hfpatch.tiny import char_text, char_tokenizer
from hfpatch.train.checkpoint import cut_log
from hfpatch.utils.files import write_file, write_json, write_text

PACKAGE = Path(__file__).resolve().parents[1] / "hfpatch"
ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

# The renames of the package outside utils/files.py: folders, each put in place whole by its own code (a card's
# plots folder, llama.cpp's converted folder, the GGUF cache's parts). No file is written this way.
FOLDER_RENAMES = {
    "evaluate/card.py:_write",
    "evaluate/llamacpp.py:exports_folder",
    "interop/gguf_cache.py:_remove",
    "interop/gguf_cache.py:_finish",
}


def half_then(error: BaseException):
    """A write(tmp) that puts half of its text at tmp, then fails with `error`."""
    def write(tmp: Path) -> None:
        tmp.write_text("{half")
        raise error
    return write


def test_a_file_is_replaced_whole_and_no_temporary_file_stays(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("old")
    assert write_file(path, lambda tmp: tmp.write_text("new")) == path
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["a.json"]


@pytest.mark.parametrize("error", [ENOSPC, SafetensorError("I/O error: No space left on device (os error 28)")],
                         ids=["OSError", "SafetensorError"])
def test_a_full_disk_mid_write_keeps_the_old_file_and_is_one_oserror_naming_it(tmp_path, error):
    path = tmp_path / "a.json"
    path.write_text("old")
    with pytest.raises(OSError) as caught:
        write_file(path, half_then(error))
    assert (caught.value.errno, caught.value.filename) == (errno.ENOSPC, str(path))
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_an_interrupt_mid_write_keeps_the_old_file_and_no_temporary_file(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        write_file(path, half_then(KeyboardInterrupt()))
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_write_text_words_a_full_disk_in_one_line_and_write_json_names_the_file(tmp_path, monkeypatch):
    real = Path.write_text

    def filling(self, text, *args, **kwargs):
        real(self, text[: len(text) // 2], *args, **kwargs)
        raise ENOSPC

    monkeypatch.setattr(Path, "write_text", filling)
    with pytest.raises(ValueError, match=f"^could not write {tmp_path / 'a.md'}: no space left on the device"):
        write_text(tmp_path / "a.md", "text")
    with pytest.raises(OSError) as caught:
        write_json(tmp_path / "b.json", {"a": 1})
    assert caught.value.filename == str(tmp_path / "b.json")
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_while_the_token_cache_is_written_leaves_no_temporary_file(tmp_path, monkeypatch):
    """The token cache is an optimisation: a failed write of an entry is passed over, and leaves nothing behind."""
    monkeypatch.setenv("HFPATCH_CACHE", str(tmp_path))

    def savez(file, **arrays):  # half a zip archive, given a path or an open file, then the full disk
        if isinstance(file, (str, os.PathLike)):
            Path(file).write_bytes(b"PK\x03\x04 half")
        else:
            file.write(b"PK\x03\x04 half")
        raise ENOSPC

    monkeypatch.setattr(np, "savez", savez)
    doc = lm_text.Document("d", char_text(200, 0))
    tokens = lm_text.tokenize(char_tokenizer(), doc)
    assert len(tokens.ids) == 200
    assert [p for p in (tmp_path / "tokens").rglob("*") if p.is_file()] == []


def test_a_full_disk_while_the_log_is_cut_keeps_the_log_and_no_temporary_file(tmp_path, monkeypatch):
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)))
    before = log.read_bytes()
    real = Path.write_text

    def filling(self, text, *args, **kwargs):
        real(self, text[: len(text) // 2], *args, **kwargs)
        raise ENOSPC

    monkeypatch.setattr(Path, "write_text", filling)
    with pytest.raises(OSError) as caught:
        cut_log(log, 2)
    assert log.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["log.jsonl"]
    assert caught.value.filename == str(log)


def _renames(tree: ast.AST) -> list[str]:
    """The functions of a module that call os.replace, os.rename or shutil.move."""
    found = []
    for f in ast.walk(tree):
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            calls = [ast.unparse(c.func) for c in ast.walk(f) if isinstance(c, ast.Call)]
            if any(c in ("os.replace", "os.rename", "shutil.move") for c in calls):
                found.append(f.name)
    return found


def test_the_package_renames_files_into_place_only_through_write_file():
    """No hand-rolled temporary-file-and-rename writer beside utils/files.py: the renames left are of folders."""
    found = {f"{path.relative_to(PACKAGE)}:{name}"
             for path in PACKAGE.rglob("*.py") if path.relative_to(PACKAGE) != Path("utils/files.py")
             for name in _renames(ast.parse(path.read_text()))}
    assert found == FOLDER_RENAMES
