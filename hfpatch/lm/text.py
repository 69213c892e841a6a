"""Text for the evaluations and the recipes: local files and folders, a `datasets` dataset, or the default corpus;
tokenization with the tokenizer given, cached. Loading a model's tokenizer is tokenizer.py's: this module imports
neither torch nor transformers, so the evaluation modules can import it at their top and answer --help at once.

The default corpus is a fixed list of long, pure-Python modules of the standard library of the Python that runs
hfpatch: every install has them, no download is needed. They are source code, so their perplexities are lower than
those of prose, and they change a little between Python versions (the version is recorded with the results).

Tokenization is cached (`$HFPATCH_CACHE/tokens`, default `~/.cache/hfpatch/tokens`), keyed by a hash of the
tokenizer's full definition and of the text, so a changed file or another tokenizer never reads a stale entry.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..utils.files import cache_dir, write_file

# Long modules present in every CPython >= 3.10, longest first; the default corpus is those found on disk.
STDLIB_FILES = (
    "_pydecimal.py", "inspect.py", "typing.py", "tarfile.py", "doctest.py", "pydoc.py", "argparse.py",
    "email/_header_value_parser.py", "subprocess.py", "difflib.py", "enum.py", "mailbox.py", "_pyio.py",
    "pickletools.py",
)
CACHE_FORMAT = 1


@dataclass(frozen=True)
class Document:
    name: str
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


@dataclass
class Tokens:
    """Token ids of a document and, per token, the UTF-8 byte offset in the text where it ends.

    Token i owns the bytes from the end of token i-1 to its own end (whitespace before a word goes with the word;
    special tokens own nothing), so the bytes of a run of tokens [a, b) are ends[b-1] - ends[a-1]."""

    ids: np.ndarray  # int64 [n]
    ends: np.ndarray  # int64 [n], non-decreasing
    exact_bytes: bool  # False when the tokenizer gave no offsets and bytes came from decoding tokens one by one

    def __len__(self) -> int:
        return len(self.ids)

    def bytes_between(self, a: int, b: int) -> int:
        """UTF-8 bytes owned by tokens a..b-1."""
        return int(self.ends[b - 1] - (self.ends[a - 1] if a > 0 else 0))


# ---------------------------------------------------------------------------------------------------------------
# sources


class NoSuchPath(FileNotFoundError, ValueError):
    """A text file or folder that is not there: a FileNotFoundError, and a ValueError as every other bad input is
    (the Python API's callers catch one error for bad input)."""


def text_files(paths: Iterable[str]) -> list[Document]:
    """Files as given; folders contribute their *.txt files (recursively, sorted by path). A path that is not a
    string (or os.PathLike) is a TypeError; an empty one, a folder without .txt files, a file that is not UTF-8 text
    a ValueError; a path that is not there a NoSuchPath (a FileNotFoundError and a ValueError)."""
    files: list[Path] = []
    for raw in paths:
        if not isinstance(raw, (str, os.PathLike)):
            raise TypeError(f"text files are paths (str or os.PathLike), got {raw!r} ({type(raw).__name__})")
        if not str(raw).strip():
            raise ValueError(f"a text file's path is empty ({str(raw)!r}): give a file, or a folder of .txt files")
        p = Path(raw).expanduser()
        if p.is_dir():
            found = sorted(q for q in p.rglob("*.txt") if q.is_file())
            if not found:
                raise ValueError(f"folder {raw} has no .txt files")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise NoSuchPath(f"no such file or folder: {raw}")
    docs = []
    for f in files:
        try:
            docs.append(Document(str(f), f.read_text(encoding="utf-8")))
        except UnicodeDecodeError as e:
            raise ValueError(f"{f}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except OSError as e:
            raise ValueError(f"{f}: cannot read it ({e.strerror})") from None
    return docs


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def default_corpus() -> list[Document]:
    root = stdlib_root()
    docs = [Document(f"stdlib/{name}", (root / name).read_text(encoding="utf-8"))
            for name in STDLIB_FILES if (root / name).is_file()]
    if not docs:
        raise ValueError(f"the default corpus (long modules of the standard library) is not under {root}; "
                         "give --text-files or --dataset")
    return docs


def dataset_documents(name: str, config: str | None = None, split: str = "test",
                      text_field: str = "text") -> Iterator[Document]:
    """Rows of a `datasets` dataset, streamed (a large hub dataset is not downloaded beyond what is used)."""
    try:
        import datasets  # only --dataset reads it, and importing it costs about a second

        ds = datasets.load_dataset(name, config, split=split, streaming=True)
        rows = iter(ds)
        first = next(rows, None)
    except Exception as e:  # the datasets library raises many types for a missing/unknown dataset or split
        raise ValueError(f"could not load dataset {name!r} (config {config!r}, split {split!r}): "
                         f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None
    if first is None:
        raise ValueError(f"dataset {name!r} split {split!r} is empty")
    if text_field not in first:
        raise ValueError(f"dataset {name!r} has no field {text_field!r}; its fields: {', '.join(first)} "
                         "(choose one with --text-field)")
    i = 0
    for row in ([first], rows):
        for r in row:
            text = r[text_field]
            if not isinstance(text, str):
                raise ValueError(f"dataset {name!r} field {text_field!r} holds {type(text).__name__}, not text")
            yield Document(f"{name}:{split}[{i}]", text)
            i += 1


def describe_source(text_files_arg: Any = None, dataset: str | None = None, config: str | None = None,
                    split: str | None = None, text_field: str | None = None) -> dict:
    if dataset:
        return {"kind": "dataset", "name": dataset, "config": config, "split": split, "text_field": text_field}
    if text_files_arg:
        return {"kind": "files", "paths": [str(p) for p in text_files_arg]}
    return {"kind": "stdlib", "root": str(stdlib_root()), "python": sys.version.split()[0]}


def documents(text_files_arg: Any = None, dataset: str | None = None, config: str | None = None, split: str = "test",
              text_field: str = "text") -> Iterable[Document]:
    if dataset:
        return dataset_documents(dataset, config, split, text_field)
    if text_files_arg:
        return text_files(text_files_arg)
    return default_corpus()


# ---------------------------------------------------------------------------------------------------------------
# tokenization (cached)


# Keyed by the tokenizer object itself, held weakly: a cache keyed by id() handed a freed tokenizer's fingerprint
# to a new tokenizer that Python placed at the same address.
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tokenizer_fingerprint(tok: Any) -> str:
    """A hash of everything that decides the ids: the full tokenizer definition for fast tokenizers (vocabulary,
    merges, normalizer, pre-tokenizer, post-processor, added tokens), else the class, vocabulary and special tokens.
    Serializing the vocabulary takes tens of ms, too long for every document: the hash is cached per tokenizer
    object, and computed again whenever a cheap key of it changes (its size, the serialized normalizer,
    pre-tokenizer, post-processor and decoder, the added tokens, the BOS/EOS settings), so a tokenizer edited in
    place (a normalizer set on it, a post-processor swapped) is never served the ids of its former self."""
    key = _cheap_key(tok)
    cached = _FINGERPRINTS.get(tok)
    if cached is None or cached[0] != key:
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is not None:
            blob = backend.to_str()  # the full definition (the BOS/EOS settings live in its post-processor)
        else:
            vocab = sorted(tok.get_vocab().items())
            blob = repr((key, vocab))
        cached = (key, hashlib.sha256(blob.encode("utf-8")).hexdigest())
        _FINGERPRINTS[tok] = cached
    return cached[1]


def _cheap_key(tok: Any) -> str:
    """What can change on a tokenizer object and is quick to read (microseconds)."""
    parts = [type(tok).__name__, len(tok), tok.all_special_tokens, getattr(tok, "add_bos_token", None),
             getattr(tok, "add_eos_token", None)]
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        for name in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
            part = getattr(backend, name)
            parts.append(part.__getstate__() if part is not None else None)
        model = backend.model
        parts += [type(model).__name__, getattr(model, "unk_token", None), backend.truncation, backend.padding,
                  sorted((i, repr(t)) for i, t in backend.get_added_tokens_decoder().items())]
    return repr(parts)


def _byte_offsets(text: str) -> np.ndarray:
    """char index -> UTF-8 byte offset, for char indices 0..len(text)."""
    cp = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    nbytes = 1 + (cp >= 0x80).astype(np.int64) + (cp >= 0x800) + (cp >= 0x10000)
    return np.concatenate([[0], np.cumsum(nbytes)])


def _tokenize(tok: Any, text: str) -> Tokens:
    # The tokenizer's own defaults (a BOS where it adds one), as users of the model would tokenize a document.
    if getattr(tok, "is_fast", False):
        enc = tok(text, return_offsets_mapping=True, verbose=False)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        char_ends = np.asarray([e for _, e in enc["offset_mapping"]], dtype=np.int64)
        ends = _byte_offsets(text)[char_ends] if len(ids) else np.zeros(0, np.int64)
        ends = np.maximum.accumulate(ends) if len(ends) else ends  # special tokens report (0, 0)
        return Tokens(ids, ends, True)
    ids = np.asarray(tok(text, verbose=False)["input_ids"], dtype=np.int64)
    special = set(tok.all_special_ids)
    sizes = [0 if i in special else len(tok.decode([int(i)]).encode("utf-8")) for i in ids]
    return Tokens(ids, np.cumsum(np.asarray(sizes, dtype=np.int64)), False)


def tokenize(tok: Any, doc: Document, use_cache: bool = True) -> Tokens:
    if not use_cache:
        return _tokenize(tok, doc.text)
    key = hashlib.sha256(f"{CACHE_FORMAT}\0{tokenizer_fingerprint(tok)}\0{doc.sha256}".encode()).hexdigest()
    path = cache_dir() / "tokens" / key[:2] / f"{key}.npz"
    if path.is_file():
        try:
            with np.load(path) as z:
                return Tokens(z["ids"], z["ends"], bool(z["exact"]))
        except (OSError, ValueError, KeyError):
            pass  # a damaged entry: tokenize again and overwrite it
    out = _tokenize(tok, doc.text)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, lambda tmp: _save_tokens(tmp, out))
    except OSError:
        pass  # a read-only home: the cache is an optimisation only
    return out


def _save_tokens(path: Path, tokens: Tokens) -> None:
    """A cache entry of `tokens` at `path` as it is named (np.savez given a name adds .npz to it; given a file, not)."""
    with open(path, "wb") as f:
        np.savez(f, ids=tokens.ids, ends=tokens.ends, exact=np.asarray(tokens.exact_bytes))


def joined_ids(tok: Any, docs: Iterable[Document], max_tokens: int | None = None) -> np.ndarray:
    """The documents' token ids end to end, the tokenizer's EOS token after each (where it has one), cut to the
    first max_tokens (None: all); documents past those are not read. int64 [n]."""
    return joined_text_ids(tok, docs, max_tokens)[0]


def joined_text_ids(tok: Any, docs: Iterable[Document], max_tokens: int | None = None) -> tuple[np.ndarray, int]:
    """joined_ids, and how many of its ids are the documents' own (the EOS tokens joining them not counted)."""
    eos = tok.eos_token_id
    parts: list[tuple[np.ndarray, bool]] = []  # (ids, whether they are a document's own)
    total = 0
    for doc in docs:
        ids = tokenize(tok, doc).ids
        parts.append((ids, True))
        if eos is not None:
            parts.append((np.asarray([eos], dtype=np.int64), False))
        total += len(ids)
        if max_tokens and total >= max_tokens:
            break
    ids = np.concatenate([p for p, _ in parts]) if parts else np.zeros(0, np.int64)
    kept = min(max_tokens, len(ids)) if max_tokens else len(ids)
    own, seen = 0, 0
    for part, is_own in parts:
        taken = min(len(part), kept - seen)
        own += taken if is_own else 0
        seen += taken
    return ids[:kept], own
