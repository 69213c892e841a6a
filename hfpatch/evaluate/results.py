"""The resumable results file of an evaluation: OUT/results.json, rewritten atomically after every finished unit of
work (a document of a cell, a trial, a sample).

A file is continued only if it was written for the same identity (everything that decides the numbers besides the
cell coordinates: the model's files by content, dtype, corpus, seed, ...). Loading it checks what a crash or a hand
edit could have broken — that it is UTF-8 JSON, that each cell has its fields, and that every finished cell's numbers
are what its records give — and stops with what is wrong and how to recover, rather than mixing damaged numbers into
new results.
The file is strict JSON: a number that is not finite (a NaN loss, an overflow) is written as null, so that any JSON
reader takes the file and a rerun compares its numbers with what the records give.
A lock on OUT keeps two runs from writing the same file.
"""

from __future__ import annotations

import copy
import datetime
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..utils.files import Lock, Locked, describe_os_error, differences, write_failure, write_file

FORMAT = 3  # 3: the identity holds the model's files by content (model_files)


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def null_non_finite(value: Any) -> None:
    """Replace, in place, every NaN and ±inf inside `value` (nested dicts and lists; tuples become lists) with None:
    JSON has no such numbers. In place, because the loop holds the cells it is filling."""
    if isinstance(value, dict):
        keys = list(value)
    elif isinstance(value, list):
        keys = list(range(len(value)))
    else:
        return
    for k in keys:
        v = value[k]
        if isinstance(v, float) and not math.isfinite(v):
            value[k] = None
        else:
            if isinstance(v, tuple):
                value[k] = v = list(v)
            null_non_finite(v)


def _non_finite_as_null(constant: str) -> None:
    """A bare NaN or Infinity (not JSON, but what Python's json writes unless told not to, and what older results
    files hold): read as null, which is how this module writes such a number."""
    return None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-9)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


class Results:
    """`records`: the cell field that holds one entry per unit of work ("documents", "trials", "samples");
    `summarize(records) -> dict`: a finished cell's numbers, recomputed on load to check them.
    `read_only` (a dry run): an existing file is read and checked, but nothing is created, locked or written."""

    def __init__(self, path: Path, kind: str, identity: dict, records: str, summarize: Callable[..., Any],
                 overwrite: bool = False,
                 read_only: bool = False) -> None:
        self.path = Path(path)
        self.kind, self.records, self.summarize = kind, records, summarize
        self.read_only = read_only
        self._lock: Lock | None = None
        if not read_only:
            self._open()
        loaded = None
        if self.path.exists() and not overwrite:
            try:
                loaded = self._load(identity)
            except ValueError:
                self.close()
                raise
        self.data: dict = loaded if loaded is not None else {
            "kind": kind, "format": FORMAT, "identity": identity, "cells": [], "started": now()}
        self.resumed = bool(self.data["cells"])

    def _open(self) -> None:
        """Create the folder, take the lock, remove what a killed run left half-written."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a file where a folder should be, a read-only place
            raise ValueError(f"--out {self.path.parent}: cannot create it ({describe_os_error(e)})") from None
        try:
            self._lock = Lock(self.path.with_name(self.path.name + ".lock"), str(self.path))
        except Locked as e:
            raise ValueError(f"another run is writing {self.path} now (process {e.pid or 'unknown'}); wait for it "
                             "or use another --out") from None
        for stale in self.path.parent.glob(self.path.name + ".*.tmp"):  # left by a killed run (we hold the lock)
            stale.unlink(missing_ok=True)

    def _damaged(self, what: str) -> ValueError:
        return ValueError(f"{self.path}: {what}. The file was damaged or edited by hand: repair it, or start over "
                          f"with --overwrite (or another --out); the finished cells it holds would be computed again")

    def _load(self, identity: dict) -> dict:
        try:
            text = self.path.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"{self.path}: cannot read it ({e.strerror})") from None
        except UnicodeDecodeError as e:
            raise self._damaged(f"not UTF-8 text ({e.reason} at byte {e.start})") from None
        try:
            data = json.loads(text, parse_constant=_non_finite_as_null)
        except json.JSONDecodeError as e:
            raise self._damaged(f"not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
        if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
            raise self._damaged("not an hfpatch results file (no list of cells)")
        if data.get("kind") != self.kind:
            raise ValueError(f"{self.path} holds {data.get('kind')!r} results, not {self.kind!r}; use another --out")
        if data.get("format") != FORMAT:
            raise ValueError(f"{self.path} was written in results format {data.get('format')} by another version "
                             f"of hfpatch (this one writes {FORMAT}); use another --out, or --overwrite")
        old = data.get("identity") if isinstance(data.get("identity"), dict) else {}
        if old != identity:
            diff = differences(old, identity)
            named = ", ".join(diff[:8]) + (f" and {len(diff) - 8} more" if len(diff) > 8 else "")
            raise ValueError(f"{self.path} was written by a run with other settings ({named} differ); "
                             "use another --out, or --overwrite to discard it")
        for i, cell in enumerate(data["cells"]):
            self._check_cell(i, cell)
        return data

    def _check_cell(self, i: int, cell: dict) -> None:
        if not isinstance(cell, dict) or not isinstance(cell.get("patch"), str):
            raise self._damaged(f"cell {i} is not a cell (no patch)")
        name = f"cell {i} ({', '.join(f'{k}={v}' for k, v in cell.items() if isinstance(v, (str, int, float)))})"
        records = cell.get(self.records)
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            raise self._damaged(f"{name} has no list of {self.records}")
        if cell.get("complete") is True:
            try:
                expected = self.summarize(records)
                null_non_finite(expected)  # as it was written
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
                raise self._damaged(f"{name}: its {self.records} cannot be summarized ({type(e).__name__}: {e})") from e
            wrong = sorted(k for k, v in expected.items() if not _same(cell.get(k), v))
            if wrong:
                raise self._damaged(f"{name}: {', '.join(wrong)} differ from what its {self.records} give")
        elif cell.get("complete") is not False:
            raise self._damaged(f"{name}: 'complete' is {cell.get('complete')!r}, not true or false")

    def find(self, key: dict) -> dict | None:
        return next((c for c in self.data["cells"] if all(c.get(k) == v for k, v in key.items())), None)

    def cell(self, key: dict, make: Callable[[], dict]) -> dict:
        """The cell with these coordinates, created by make() if absent."""
        c = self.find(key)
        if c is not None:
            return c
        c = make()
        self.data["cells"].append(c)
        return c

    def finish(self, cell: dict) -> None:
        cell.update(self.summarize(cell[self.records]), complete=True, finished=now())

    def save(self, **top: Any) -> None:
        if self.read_only:
            raise RuntimeError(f"{self.path} was opened read-only (a dry run): nothing may be written")
        self.data.update(top)
        self.data["updated"] = now()
        null_non_finite(self.data)  # the report, drawn from self.data, then reads what the file holds
        text = json.dumps(self.data, indent=1, allow_nan=False) + "\n"
        try:  # whole: a killed run leaves the previous complete file, never half of one
            write_file(self.path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
        except OSError as e:  # a full disk: the previous complete file stays, no temporary file
            raise ValueError(f"{write_failure(e)}; it holds the results finished before, and the same command "
                             "resumes from them") from None

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()


def comparable(data: dict) -> dict:
    """A results file without what differs between two runs of the same work (times, the command's argv, the list
    of runs with their estimates): two runs of the same cells, interrupted or not, give equal ones."""
    data = copy.deepcopy(data)
    for key in ("started", "updated", "finished", "seconds", "runs"):
        data.pop(key, None)
    data.get("settings", {}).pop("argv", None)
    for cell in data.get("cells", []):
        cell.pop("finished", None)
        cell.pop("seconds", None)
        for record in cell.get("documents", []) + cell.get("trials", []) + cell.get("samples", []):
            record.pop("seconds", None)
    return data
