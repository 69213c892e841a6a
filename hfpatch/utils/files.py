"""What the evaluations and the recipes share about the files they read and write: a lock that keeps two runs out
of one output, content hashes (of checkpoints, of the model a results file was computed with), and folders that are
only ever seen complete under their real name.

Content hashes are SHA-256 of the whole file. Hashing a model's files costs a read of them (about 1 GB/s here), so
the digest of a file is cached under $HFPATCH_CACHE/files, keyed by its path and its stat (size, inode, mtime,
ctime: any write changes the ctime); a copy of the same model elsewhere is hashed again and gets the same digest.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

try:
    import fcntl
except ImportError:  # not on Windows: no lock there
    fcntl = None  # type: ignore[assignment]  # checked for None before use

PARTIAL = ".partial"  # suffix of a folder being written (or being deleted)
_BLOCK = 8 << 20


# ---------------------------------------------------------------------------------------------------------------
# locks


class Locked(ValueError):
    """The lock is held by another process (`pid`, when it wrote it)."""

    def __init__(self, message: str, pid: int | None) -> None:
        super().__init__(message)
        self.pid = pid


class Lock:
    """An exclusive lock on the file `path` (created if absent), held until close(); the OS releases it when the
    process dies. The holder writes its pid into the file, so a refused run can say which process holds it.

    close() removes the file, while still holding the lock, so a finished run leaves none behind. That is safe
    because a lock counts only if, once taken, it is on the file `path` names: a run that opened the file before
    the holder removed it, and locks it after, finds the name gone or naming a newer file, and tries again on that
    one (without the check, two runs could each lock a different file of the same name). A killed run leaves its
    file; the next run takes it over."""

    def __init__(self, path: Path | str, what: str) -> None:
        self.path = Path(path)
        while True:
            # "a+", not "w": that would empty the holder's pid before the lock is tried
            self._file = open(self.path, "a+")  # noqa: SIM115 - held open for the lock's life, closed by close()
            try:
                if fcntl is not None:
                    fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._file.seek(0)
                text = self._file.read().strip()
                self._file.close()
                pid = int(text) if text.isdigit() else None
                raise Locked(f"{what} is in use by another run (process {pid if pid else 'unknown'}); wait for it "
                             f"to end, or stop it", pid) from None
            if self._names_our_file():
                break
            self._file.close()  # removed (or replaced) by the run that held it until now: lock the file there now
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"{os.getpid()}\n")
        self._file.flush()

    def _names_our_file(self) -> bool:
        try:
            named = os.stat(self.path)
        except FileNotFoundError:
            return False
        ours = os.fstat(self._file.fileno())
        return (named.st_dev, named.st_ino) == (ours.st_dev, ours.st_ino)

    def close(self) -> None:
        if self._file.closed:
            return
        if fcntl is not None:  # only with real locks: without them nothing tells whose file it is
            self.path.unlink(missing_ok=True)  # still held: no other run can have taken it
        self._file.close()

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------------------------
# content hashes


def sha256(path: Path | str) -> str:
    """SHA-256 of a file's content, read in 8 MiB blocks (hashlib releases the GIL on each: files hash in parallel
    threads)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def sha256_many(paths: list, threads: int = 4) -> list[str]:
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(paths), os.cpu_count() or 1))) as pool:
        return list(pool.map(sha256, paths))


def _stat_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}\0{st.st_size}\0{st.st_ino}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"
                          .encode()).hexdigest()


def cache_dir() -> Path:
    """hfpatch's cache folder: $HFPATCH_CACHE, else $XDG_CACHE_HOME/hfpatch, else ~/.cache/hfpatch (the XDG base
    directory convention, as huggingface_hub places its own cache; a relative XDG_CACHE_HOME is ignored, as the
    convention says)."""
    own = os.environ.get("HFPATCH_CACHE")
    if own:
        return Path(own).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "hfpatch"


def source_hash(modules: tuple[str, ...] = ()) -> str:
    """A hash of hfpatch's own source (every .py file of the package, or the `modules` named by their paths in it, by
    path and content): what a cache of results that hfpatch's code computed is keyed by."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for f in sorted(root / m for m in modules) if modules else sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def cached_sha256(path: Path | str) -> str:
    """sha256(path), remembered per (path, stat) in the cache folder (see the module docstring)."""
    path = Path(path)
    key = _stat_key(path)
    entry = cache_dir() / "files" / key[:2] / key
    try:
        digest = entry.read_text().strip()
        if len(digest) == 64:
            return digest
    except OSError:
        pass
    digest = sha256(path)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        write_file(entry, lambda tmp: tmp.write_text(digest))
    except OSError:
        pass  # a read-only cache: hashing again next time is only slower
    return digest


def differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """The keys (a/b for nested dicts) whose values differ between two JSON-like dicts."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [prefix] if old != new else []
    out = []
    for key in sorted(set(old) | set(new), key=str):
        out += differences(old.get(key), new.get(key), f"{prefix}/{key}" if prefix else str(key))
    return out


# ---------------------------------------------------------------------------------------------------------------
# folders written whole


def fsync(path: Path | str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, path: Path) -> None:
    """Give the finished folder `tmp` its name `path` in one rename, after its files reached the disk. A folder
    already at `path` is first renamed out of the way and deleted, so `path` is at every instant either the old
    complete folder, absent, or the new one."""
    for f in tmp.rglob("*"):
        if f.is_file():
            fsync(f)
    fsync(tmp)
    if path.exists():
        trash = path.with_name(path.name + ".old" + PARTIAL)
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(path, trash)
        shutil.rmtree(trash)
    os.rename(tmp, path)
    fsync(path.parent)


def write_whole(path: Path | str, write: Callable[[Path], Any], owned: Callable[[str], bool] | None = None) -> Path:
    """Write a folder through `write(tmp)` into `path.partial`, then publish it as `path`. When writing fails or is
    interrupted, the partial folder is removed and what was at `path` before stays as it was; a failure of the disk
    (a full disk, a read-only place, safetensors' own error for them included) is an OSError naming `path`.

    With `owned` (a test on the names at a folder's top level), a folder already at `path` is not replaced whole:
    only its entries that `write` wrote again, or for which owned(name) holds, are replaced or removed
    (merge_into); everything else in it stays."""
    path = Path(path)
    tmp = path.with_name(path.name + PARTIAL)
    try:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while writing
        write(tmp)
        if owned is not None and path.is_dir():
            merge_into(tmp, path, owned)
        else:
            publish(tmp, path)
    except BaseException as e:  # Ctrl-C included: nothing half-written stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        failed = os_error_of(e)
        if failed is None:
            raise
        raise OSError(failed.errno, failed.strerror, str(path)) from None
    return path


def merge_into(tmp: Path, path: Path, owned: Callable[[str], bool]) -> None:
    """Put the finished folder `tmp`'s entries into the existing folder `path`: the entries of `path` that `tmp`
    holds too, or for which owned(name) holds, are first moved aside (into `path.old.partial`, deleted at the end),
    then `tmp`'s entries are moved in; every other entry of `path` stays where it is, untouched. Every move is a
    rename in one file system; one that fails puts back what was moved, so `path` holds the old entries or the new
    ones, never a mix (short of the process being killed during the renames)."""
    for f in tmp.rglob("*"):
        if f.is_file():
            fsync(f)
    fsync(tmp)
    new = sorted(p.name for p in tmp.iterdir())
    aside = path.with_name(path.name + ".old" + PARTIAL)
    shutil.rmtree(aside, ignore_errors=True)  # a killed run's: the old entries it had moved aside, none of the rest
    leaving = sorted(p.name for p in path.iterdir() if p.name in new or owned(p.name))
    aside.mkdir()
    moved_out: list[str] = []
    moved_in: list[str] = []
    try:
        for name in leaving:
            os.rename(path / name, aside / name)
            moved_out.append(name)
        for name in new:
            os.rename(tmp / name, path / name)
            moved_in.append(name)
    except BaseException:
        for name in reversed(moved_in):
            os.rename(path / name, tmp / name)
        for name in reversed(moved_out):
            os.rename(aside / name, path / name)
        shutil.rmtree(aside, ignore_errors=True)
        raise
    fsync(path)
    shutil.rmtree(aside)
    tmp.rmdir()


def write_folder(path: Path | str, write: Callable[[Path], Any], owned: Callable[[str], bool] | None = None) -> Path:
    """write_whole, its disk failure a ValueError naming `path` (the commands' one line)."""
    try:
        return write_whole(path, write, owned)
    except OSError as e:
        raise ValueError(write_failure(e)) from None


# safetensors' writer (Rust) reports the OS error inside its message: "I/O error: No space left on device (os
# error 28)", older versions "IoError(Os { code: 28, ... })"
_OS_ERROR = re.compile(r"\(os error (\d+)\)|code: (\d+)")


def os_error_of(e: BaseException) -> OSError | None:
    """The OSError behind a failed write: `e` itself, or the one a SafetensorError reports in its message (it is not
    an OSError, so a full disk under safetensors escaped every `except OSError`); None for any other error."""
    if isinstance(e, OSError):
        return e
    if isinstance(e, SafetensorError):
        found = _OS_ERROR.search(str(e))
        if found:
            code = int(found.group(1) or found.group(2))
            return OSError(code, os.strerror(code))
    return None


def write_failure(e: OSError) -> str:
    """'could not write PATH: why', for an OSError whose filename is what was being written."""
    where = f"could not write {e.filename}: " if e.filename else ""
    return where + describe_os_error(OSError(e.errno, e.strerror) if e.errno is not None else e)


def describe_os_error(e: OSError) -> str:
    """An OSError in words a user can act on: the full-disk case says so."""
    if e.errno == errno.ENOSPC:
        return "no space left on the device; free some space and run again"
    if e.errno == errno.EDQUOT:
        return "the disk quota is used up; free some space and run again"
    where = f" ({e.filename})" if e.filename else ""
    return f"{e.strerror or e}{where}"


def write_file(path: Path | str, write: Callable[[Path], Any]) -> Path:
    """Write the file `path` whole, the one way hfpatch writes a file that someone may read while it is written or
    a run may be killed in: `write(tmp)` writes the content at a temporary path beside `path`
    (`<name>.<pid>.tmp`, in the same folder so that the rename is atomic); that file is synced to the disk, renamed
    over `path`, and the folder synced. A reader, or a run killed meanwhile, sees the old file or the new one, never
    half of one. Any failure (Ctrl-C included) removes the temporary file and leaves what was at `path` as it was; a
    failure of the disk (a full disk, a read-only place, safetensors' own error for them included) is an OSError
    naming `path` (write_failure words it for a user)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        fsync(tmp)
        os.replace(tmp, path)
        fsync(path.parent)
    except BaseException as e:  # a full disk, Ctrl-C mid-write: the previous file stays, no temporary file
        tmp.unlink(missing_ok=True)
        failed = os_error_of(e)
        if failed is None:
            raise
        raise OSError(failed.errno, failed.strerror or str(failed), str(path)) from None
    return path


def write_text(path: Path | str, text: str) -> Path:
    """write_file of a text (UTF-8), its disk failure a ValueError naming `path` (the commands' one line)."""
    try:
        return write_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    except OSError as e:
        raise ValueError(write_failure(e)) from None


def write_json(path: Path | str, value: Any) -> Path:
    """write_file of `value` as JSON (indented by one space, the form of hfpatch's results files); a failure of the
    disk is write_file's OSError naming `path`."""
    text = json.dumps(value, indent=1)
    return write_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
