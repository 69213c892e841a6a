"""Fault injection for the recipes' promise that a run killed anywhere resumes to the same result: a testing tool,
outside the package (nothing of hfpatch imports it). Used by tests/test_recipe_faults.py and eval/soak_recipe.py.

    python -m eval.faults --root OUT [--kill-at N [--match REGEX]] [--trace FILE] RECIPE.py [key=value ...]

(from the repository root, like every eval/ script.)

Runs the recipe script in this process with every file operation under OUT observed as an event: torch.save and
safetensors' save_file (weights, optimizer and RNG states, as accelerate and transformers call them), open() for
writing (log rows, markers, configs, tokenizer files), os.rename / os.replace and shutil.rmtree. --trace appends one
JSON line per event ({"n", "kind", "path"}, path relative to OUT) before the event happens. --kill-at N: at the N-th
event (from 0) whose "kind path" matches --match, the process SIGKILLs itself: torch.save / save_file write their
file, which is then cut to half its size, and a file opened for writing gets half of its first write (torn writes),
before the kill; renames and rmtree are killed just before they happen. The hooks run inside the process, so the
kill lands exactly there, every time.
"""

from __future__ import annotations

import argparse
import builtins
import io
import json
import os
import re
import runpy
import shutil
import signal
import sys

import accelerate.utils.other as accelerate_io
import torch
import transformers.modeling_utils as modeling_utils

_open = builtins.open


class Injector:
    """The hooks: every file operation under `root` is an event, counted and traced; one of them can kill."""

    def __init__(self, root, kill_at=None, match="", trace=None):
        self.root = os.path.realpath(root)
        self.kill_at, self.match = kill_at, re.compile(match or "")
        self.trace = trace
        self.seen = self.matched = 0

    def under_root(self, path) -> str | None:
        if not isinstance(path, (str, os.PathLike)):
            return None
        full = os.path.realpath(os.fspath(path))
        return os.path.relpath(full, self.root) if (full + os.sep).startswith(self.root + os.sep) else None

    def event(self, kind: str, path) -> bool:
        """Record the event; True when the process must be killed at it."""
        rel = self.under_root(path)
        if rel is None:
            return False
        if self.trace:
            with _open(self.trace, "a") as f:
                f.write(json.dumps({"n": self.seen, "kind": kind, "path": rel}) + "\n")
        self.seen += 1
        if not self.match.search(f"{kind} {rel}"):
            return False
        self.matched += 1
        return self.kill_at is not None and self.matched - 1 == self.kill_at

    def writer(self, kind, fn, path_arg=1):
        """A torch.save / save_file that writes, then (when the event is the chosen one) tears the file and dies."""
        def hooked(*args, **kwargs):
            path = args[path_arg] if len(args) > path_arg else kwargs.get("f", kwargs.get("filename"))
            kill = self.event(kind, path)
            out = fn(*args, **kwargs)
            if kill:
                os.truncate(path, os.path.getsize(path) // 2)
                die()
            return out
        return hooked

    def before(self, kind, fn):
        """An operation killed just before it happens when the event is the chosen one."""
        def hooked(*args, **kwargs):
            if args and self.event(kind, args[0]):
                die()
            return fn(*args, **kwargs)
        return hooked

    def opener(self):
        """open() whose chosen file for writing gets half of its first write, then the process dies."""
        def hooked(file, mode="r", *args, **kwargs):
            f = _open(file, mode, *args, **kwargs)
            if any(c in mode for c in "wax+") and self.event("open", file):
                return _Torn(f)
            return f
        return hooked

    def install(self):
        torch.save = self.writer("torch.save", torch.save)
        accelerate_io.safe_save_file = self.writer("save_file", accelerate_io.safe_save_file)
        modeling_utils.safe_save_file = self.writer("save_file", modeling_utils.safe_save_file)
        builtins.open = io.open = self.opener()
        os.rename = self.before("rename", os.rename)
        os.replace = self.before("replace", os.replace)
        shutil.rmtree = self.before("rmtree", shutil.rmtree)


class _Torn:
    """A file object that writes half of what it is first given, then kills the process (closing it unwritten
    kills too)."""

    def __init__(self, f):
        self._f = f

    def write(self, data):
        self._f.write(data[: len(data) // 2])
        self._f.flush()
        die()

    def close(self):
        self._f.flush()
        die()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __getattr__(self, name):
        return getattr(self._f, name)


def die():
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def command(recipe, args, root, kill_at=None, match="", trace=None) -> list[str]:
    """The argv that runs `recipe` (a script path) with `args` under this injector (see the module docstring)."""
    out = [sys.executable, "-m", "eval.faults", "--root", str(root)]  # run from the repository root
    if kill_at is not None:
        out += ["--kill-at", str(kill_at), "--match", match]
    if trace:
        out += ["--trace", str(trace)]
    return [*out, str(recipe), *args]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m eval.faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True, help="only file operations under this folder are events")
    p.add_argument("--kill-at", type=int, help="SIGKILL at this matching event (0-based)")
    p.add_argument("--match", default="", help="regular expression on 'kind path' selecting the counted events")
    p.add_argument("--trace", help="append every event as a JSON line to this file (outside --root)")
    p.add_argument("recipe")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    Injector(a.root, a.kill_at, a.match, a.trace).install()
    sys.argv = [a.recipe, *a.args]
    runpy.run_path(a.recipe, run_name="__main__")


if __name__ == "__main__":
    main()
