"""GGUF files converted once: what transformers' GGUF loader makes of a file, kept in hfpatch's cache folder.

transformers reads a GGUF file by parsing all of its metadata (the tokenizer's vocabulary included) in Python and
dequantizing every tensor; hfpatch parses the metadata once more to read the RoPE scaling the file carries. For
SmolLM2-135M (the embedded default, `smollm2`) that is about 20 s, paid by every command that loads it. The cache
keeps the results under `cache_dir()/gguf/KEY/` (utils.files.cache_dir: $HFPATCH_CACHE, else
$XDG_CACHE_HOME/hfpatch, else ~/.cache/hfpatch):

    model/       the converted model as transformers saves it: config.json, generation_config.json and the float
                 weights (transformers' default dtype for the file, float32) as safetensors shards
    rope.json    the RoPE scaling hfpatch reads from the file (interop.gguf.read_patch), the warnings that reading
                 gave, and the hash of the modules that read it (ROPE_READING: read again when one changes)
    tokenizer/   the tokenizer transformers builds from the file, as its save_pretrained writes it

KEY is a hash of the file's content (its size and SHA-256, computed once per path and stat: utils.files.cached_sha256)
and of the versions of what converts it (transformers, gguf, tokenizers): a changed file or an upgrade converts
again. A model loaded from the cache has the same weights, config and logits as one loaded from the file, in any
dtype (the cached float32 weights are cast as the file's are); transformers' GGUF quantizer, which a model loaded
from the file keeps attached, is not, the weights being plain floats in both.

model/ and tokenizer/ are each written into a temporary folder beside them and renamed into place once whole, their
manifest.json (every file's size and SHA-256) written last: a killed process leaves no part that loads (its
temporary folder is removed by the next process that writes the part), and a part whose files do not match its
manifest (changed, truncated, deleted) is converted again, never loaded. A file's SHA-256 is computed once per path
and stat, as the GGUF file's is (any write changes a file's ctime), so a load from the cache does not read the
weights twice. With HFPATCH_GGUF_CACHE=off the file is loaded and converted every time. A cache folder that cannot be
written (read-only, a full disk) gives one warning, and the file is loaded as without the cache.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..apply import serializable
from ..utils import files
from ..utils.warn import warn_caller
from .gguf import Found, apply_found, read_patch

FORMAT = 1  # of the cache's entries: a change of what they hold makes new keys
ENV = "HFPATCH_GGUF_CACHE"  # "off" (or 0, false, no): load every GGUF file from the file itself
MANIFEST = "manifest.json"
SHARD = "128MB"  # the weights in shards of this size: they are hashed in parallel threads when verified
PARTIAL = ".partial"  # suffix of a part being written: <part>.<pid>.partial
SPARE = 1 << 30  # bytes of the disk a cache write leaves free, at least
# The modules that turn a GGUF file's metadata into read_patch's answer: the RoPE record is read again when one of
# them changes (tests/test_gguf_cache.py checks that reading touches no other module of hfpatch).
ROPE_READING = ("interop/gguf.py", "interop/gguf_file.py", "position/rope/llamacpp.py", "position/rope/builders.py",
                "position/registry.py", "position/signal.py", "registry.py", "spec.py")

_warned = False  # the one warning of a process whose cache folder cannot be written


def enabled() -> bool:
    """Whether GGUF conversions are cached ($HFPATCH_GGUF_CACHE is not off, 0, false or no)."""
    return os.environ.get(ENV, "").strip().lower() not in ("off", "0", "false", "no")


def entry_of(path: str) -> Path:
    """The cache folder of GGUF file `path`: keyed by its content and by the versions of the converting code."""
    size = os.path.getsize(path)
    digest = files.cached_sha256(path)
    parts = [f"format {FORMAT}", f"size {size}", f"sha256 {digest}",
             *(f"{p} {_version(p)}" for p in ("transformers", "gguf", "tokenizers"))]
    return files.cache_dir() / "gguf" / hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "none"


# ------------------------------------------------------------------------------------------------------- the model


def load_model(path: str, **kwargs: Any) -> PreTrainedModel:
    """The model in GGUF file `path` as transformers' GGUF loader converts it (kwargs: its from_pretrained's dtype,
    device_map, trust_remote_code), with the RoPE scaling the file carries applied: from the cache when it holds
    the conversion, else converted, cached, and loaded from the cache."""
    if not enabled():
        return _from_file(path, kwargs)
    entry = entry_of(path)
    part = entry / "model"
    if not _verified(part):
        uncached = _cache_model(path, entry, part, kwargs)
        if uncached is not None:
            return uncached
    model = AutoModelForCausalLM.from_pretrained(part, use_safetensors=True, **kwargs)
    model.name_or_path = model.config._name_or_path = _split(path)[0]  # as from the file: the folder it is in
    return _with_rope(model, _rope(entry, path), path)


def _cache_model(path: str, entry: Path, part: Path, kwargs: dict) -> PreTrainedModel | None:
    """Convert the file (in transformers' default dtype) and write it as the cache's model part: None once written;
    else the model to load without the cache, where the cache cannot be written (one warning) or the conversion
    keeps its weights packed (transformers' GGUF kernels), which is not cached."""
    try:
        tmp = _start(part)
    except OSError as e:
        _warn_unwritable(entry, e)
        return _from_file(path, kwargs)
    folder, name = _split(path)
    model = _converted(tmp, lambda: AutoModelForCausalLM.from_pretrained(folder, gguf_file=name))
    packed = any(type(m).__name__.lower().startswith("gguf") for m in model.modules())
    if packed:
        shutil.rmtree(tmp, ignore_errors=True)
    if packed or not _written(tmp, part, entry, lambda into: _save_model(model, into)):
        if set(kwargs) - {"trust_remote_code"}:  # asked in another dtype or place than converted: from the file
            return _from_file(path, kwargs)
        return _with_rope(model, read_patch(path), path)
    return None


def _split(path: str) -> tuple[str, str]:
    """(the folder, gguf_file=) of transformers' from_pretrained for GGUF file `path`."""
    return os.path.split(os.path.abspath(path))


def _from_file(path: str, kwargs: dict) -> PreTrainedModel:
    """The model converted from the file itself (the load without the cache)."""
    folder, name = _split(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, **kwargs)
    return _with_rope(model, read_patch(path), path)


def _with_rope(model: PreTrainedModel, found: Found | None, path: str) -> PreTrainedModel:
    apply_found(model, found, path)  # transformers reads no RoPE scaling from GGUF
    return model


def _save_model(model: PreTrainedModel, folder: Path) -> None:
    """transformers' save of the converted model, its config as converted: save_pretrained names the model's class
    in `architectures` (in the model's config too), which the file's config may leave out. A disk that would keep
    less than SPARE bytes free afterwards is refused as full (a large GGUF file converts to 4 bytes a weight)."""
    needed = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if shutil.disk_usage(folder).free < needed + SPARE:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder))
    architectures = model.config.architectures
    try:
        with serializable(model):  # the GGUF quantizer detached: the weights are plain floats
            model.save_pretrained(folder, max_shard_size=SHARD)
    finally:
        model.config.architectures = architectures
    saved = folder / "config.json"
    config = json.loads(saved.read_text(encoding="utf-8"))
    config["architectures"] = architectures
    saved.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# ------------------------------------------------------------------------------------------------- the RoPE record


def _rope(entry: Path, path: str) -> Found | None:
    """read_patch(path), from the entry's rope.json when the modules that read it are the ones it was read with;
    its warnings are given again either way."""
    record = entry / "rope.json"
    source = files.source_hash(ROPE_READING)
    found, said = _read_rope(record, source)
    if said is None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = read_patch(path)
        said = [str(w.message) for w in caught]
        _write_rope(record, source, found, said)
    for message in said:
        warn_caller(message)
    return found


def _read_rope(record: Path, source: str) -> tuple[Found | None, list[str] | None]:
    """(found, warnings) from a rope.json of this source; warnings None where there is none to use."""
    try:
        data = json.loads(record.read_text(encoding="utf-8"))
        if data["source"] != source or not all(isinstance(m, str) for m in data["warnings"]):
            return None, None
        found = None if data["found"] is None else Found(**data["found"])
        if found is not None and not (isinstance(found.rope_theta, (int, float)) and isinstance(found.window, int)
                                      and (found.patch is None or isinstance(found.patch, dict))):
            return None, None
        return found, list(data["warnings"])
    except (OSError, ValueError, KeyError, TypeError):  # absent, damaged or of another form: read the file again
        return None, None


def _write_rope(record: Path, source: str, found: Found | None, said: list[str]) -> None:
    """rope.json, written whole (a temporary file renamed), where its values come back from JSON as they are."""
    data = {"source": source, "found": None if found is None else dataclasses.asdict(found), "warnings": said}
    text = json.dumps(data)
    if json.loads(text) != data:  # a value JSON would change (a tuple): read from the file each time instead
        return
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        files.write_file(record, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    except OSError:
        pass  # a read-only cache: read from the file next time (the model part warned)


# ---------------------------------------------------------------------------------------------------- the tokenizer


def load_tokenizer(path: str, **kwargs: Any) -> PreTrainedTokenizerBase:
    """The tokenizer transformers builds from GGUF file `path` (kwargs: AutoTokenizer.from_pretrained's, such as
    trust_remote_code): from the cache when it holds it, else built, cached, and loaded from the cache."""
    folder, name = _split(path)
    if not enabled():
        return AutoTokenizer.from_pretrained(folder, gguf_file=name, **kwargs)
    entry = entry_of(path)
    part = entry / "tokenizer"
    if not _verified(part):
        try:
            tmp = _start(part)
        except OSError as e:
            _warn_unwritable(entry, e)
            return AutoTokenizer.from_pretrained(folder, gguf_file=name, **kwargs)
        tok = _converted(tmp, lambda: AutoTokenizer.from_pretrained(folder, gguf_file=name, **kwargs))
        if not _written(tmp, part, entry, tok.save_pretrained):
            return tok
    tok = AutoTokenizer.from_pretrained(part, **kwargs)
    tok.name_or_path = folder  # as from the file: the folder it is in
    return tok


# ------------------------------------------------------------------------------------------ parts written whole


def _converted(tmp: Path, convert: Callable[[], Any]) -> Any:
    """convert(); where it fails (the file's errors, an interrupt), the temporary folder goes too."""
    try:
        return convert()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _written(tmp: Path, part: Path, entry: Path, write: Callable[[Path], Any]) -> bool:
    """Write `part` through write(tmp), then publish it (_finish); False, with the one warning, where the disk
    refused (a full disk, a read-only folder). The temporary folder never stays."""
    try:
        write(tmp)
        _finish(tmp, part)
    except BaseException as e:  # an interrupt included
        shutil.rmtree(tmp, ignore_errors=True)
        failed = files.os_error_of(e)  # safetensors reports a full disk in its own error
        if failed is None:
            raise
        _warn_unwritable(entry, failed)
        return False
    return True


def _start(part: Path) -> Path:
    """A new temporary folder for writing `part` (OSError where the cache cannot be written); a part that failed
    its verification, and the temporary folders of processes that died writing it, are removed first."""
    part.parent.mkdir(parents=True, exist_ok=True)
    for stale in part.parent.glob(f"{part.name}.*{PARTIAL}"):
        pid = stale.name[len(part.name) + 1: -len(PARTIAL)]
        if not (pid.isdigit() and _alive(int(pid))):
            shutil.rmtree(stale, ignore_errors=True)
    if part.exists() and not _verified(part):  # verified now: another process just wrote it (written again)
        _remove(part)
    tmp = part.with_name(f"{part.name}.{os.getpid()}{PARTIAL}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove(part: Path) -> None:
    """Delete a part that failed its verification: renamed away first, so that its name never holds half of it."""
    trash = part.with_name(f"{part.name}.{os.getpid()}.removed{PARTIAL}")
    os.rename(part, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _finish(tmp: Path, part: Path) -> None:
    """Write the manifest (every file's size and SHA-256) last, sync, and rename `tmp` to `part`; where another
    process published `part` first, keep theirs."""
    names = sorted(p.name for p in tmp.iterdir() if p.is_file())
    digests = files.sha256_many([tmp / n for n in names])
    manifest = {"format": FORMAT,
                "files": {n: {"size": (tmp / n).stat().st_size, "sha256": d} for n, d in zip(names, digests)}}
    files.write_json(tmp / MANIFEST, manifest)
    for n in names:
        files.fsync(tmp / n)
    files.fsync(tmp)
    try:
        os.rename(tmp, part)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process wrote the same conversion
        return
    files.fsync(part.parent)
    _digests([part / n for n in names])  # remembered under their final paths: the next load verifies at once


def _verified(part: Path) -> bool:
    """Whether `part` is whole: its manifest lists its files, and each has the size and SHA-256 listed. A file's
    SHA-256 is computed once per path and stat (utils.files.cached_sha256; any write changes a file's ctime), so a
    part is hashed once, not on every load."""
    try:
        listed = json.loads((part / MANIFEST).read_text(encoding="utf-8"))["files"]
        names = sorted(listed)
        if not names or any((part / n).stat().st_size != listed[n]["size"] for n in names):
            return False
        return _digests([part / n for n in names]) == [listed[n]["sha256"] for n in names]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _digests(paths: list[Path]) -> list[str]:
    """files.cached_sha256 of each path, in parallel threads (hashlib releases the GIL)."""
    with ThreadPoolExecutor(max_workers=max(1, min(4, len(paths), os.cpu_count() or 1))) as pool:
        return list(pool.map(files.cached_sha256, paths))


def _warn_unwritable(entry: Path, e: OSError) -> None:
    """The one warning of a process whose cache folder cannot be written."""
    global _warned
    if not _warned:
        _warned = True
        warn_caller(f"the GGUF cache {entry.parent} cannot be written ({files.describe_os_error(e)}): GGUF files "
                    f"are converted on every load (set HFPATCH_CACHE to a writable folder, or {ENV}=off)")
