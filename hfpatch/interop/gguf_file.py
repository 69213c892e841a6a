"""GGUF files as files, knowing nothing of RoPE: telling one by its magic bytes, opening one with an error that says
what is wrong with it, reading a metadata value, checking where an export may write, and writing a copy with new
metadata and tensors whole or not at all (a temporary file next to the output, synced and renamed). The export
(gguf.py) decides what to write; this module writes it.
"""

from __future__ import annotations

import os
from typing import Any

from ..utils.files import describe_os_error, write_failure, write_file

MAGIC = b"GGUF"  # the first four bytes of every GGUF file


def field_value(reader: Any, key: Any, default: Any = None) -> Any:
    """The value of metadata key `key` of an open GGUFReader, or `default` where the file has no such key."""
    f = reader.get_field(key)
    return default if f is None else f.contents()


def check_output(out: str, src: str, overwrite: bool) -> None:
    """ValueError, before any work, when the export cannot or must not write `out`."""
    if not out.endswith(".gguf"):
        raise ValueError(f"the output must be a .gguf file, got {out}")
    if os.path.isdir(out):
        raise ValueError(f"the output {out} is a folder; give the path of a .gguf file to write")
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise ValueError(f"the output's folder {folder} does not exist; create it first")
    if not os.path.lexists(out):
        return
    if os.path.exists(out) and os.path.samefile(src, out):
        raise ValueError(f"the output {out} is the source file; write to another path")
    if not overwrite:
        raise ValueError(f"the output {out} exists; give overwrite=True (hfpatch patch --overwrite) to replace it, "
                         "or another path")
    if not is_gguf(out):
        raise ValueError(f"the output {out} exists and is not a GGUF file; it is never overwritten, even with "
                         "overwrite=True: move it away or write to another path")


def is_gguf(path: str) -> bool:
    """Whether `path` is a file that starts with GGUF's magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def open_gguf(path: str) -> Any:
    """A GGUFReader of `path`, or ValueError when the file cannot be parsed as GGUF (gguf-py then fails deep in its
    parser: "cannot reshape array...", "GGUF magic invalid", an index out of range...)."""
    import gguf  # an optional extra (hfpatch[gguf])

    try:
        return gguf.GGUFReader(path)
    except OSError as e:
        raise ValueError(f"could not read {path}: {describe_os_error(e)}") from None
    except Exception as e:  # any parse failure of a damaged file: the reader checks nothing up front
        size = os.path.getsize(path)
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{path} is not a readable GGUF file (truncated or damaged?): {size:,} bytes; the GGUF "
                         f"reader stopped at: {first}") from None


def write_copy(gguf: Any, reader: Any, out: str, keys: dict, drop: set, new_tensors: dict, drop_tensors: set) -> None:
    """Write `out`: the reader's metadata less `drop`, with `keys` (each where the key it replaces was, unless that
    one is dropped; the others at the end), the new tensors first, then every other tensor but `drop_tensors` byte
    for byte. Written to a file next to `out`, synced and renamed at the end, so a failure (a full disk, a read-only
    place, an interrupt) leaves what was at `out` as it was and no partial file; an OSError is a ValueError saying
    what went wrong."""
    try:
        write_file(out, lambda tmp: _write_file(gguf, reader, str(tmp), keys, drop, new_tensors, drop_tensors))
    except OSError as e:
        raise ValueError(write_failure(e)) from None


def _write_file(gguf: Any, reader: Any, path: str, keys: dict, drop: set, new_tensors: dict, drop_tensors: set) -> None:
    """write_copy's content, into `path`."""
    types = {"f32": gguf.GGUFValueType.FLOAT32, "u32": gguf.GGUFValueType.UINT32, "str": gguf.GGUFValueType.STRING}
    arch = field_value(reader, "general.architecture")
    writer = gguf.GGUFWriter(path, arch, endianess=reader.endianess)
    writer.data_alignment = reader.alignment
    try:
        pending = dict(keys)
        for f in reader.fields.values():
            if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
                continue  # written by GGUFWriter itself
            if f.name in drop:
                continue  # a scaling key: written (if at all) at the end, as from a file that never carried it
            if f.name in pending:
                value, kind = pending.pop(f.name)
                writer.add_key_value(f.name, value, types[kind])
            else:
                sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
                writer.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
        for name, (value, kind) in pending.items():
            writer.add_key_value(name, value, types[kind])
        kept = [t for t in reader.tensors if t.name not in drop_tensors]
        for name, array in new_tensors.items():
            writer.add_tensor_info(name, array.shape, array.dtype, array.nbytes, gguf.GGMLQuantizationType.F32)
        for t in kept:
            writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for array in new_tensors.values():
            writer.write_tensor_data(array)
        for t in kept:
            writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
        writer.flush()
    finally:
        writer.close()
