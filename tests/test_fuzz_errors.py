"""The one-line-error rule, fuzzed: every public entry point fed generated bad values answers with one clear error.

Targets: `hfpatch.patch` and `hfpatch patch`, `hfpatch.calibrate` and `hfpatch patch --calibrate`,
`hfpatch.evaluate.run` and `hfpatch eval NAME`, `hfpatch.search.search` and `hfpatch search`, `hfpatch card`.

The cases are generated from what the code declares, so that a new option is fuzzed without editing this file:
the position schemes' options and their forms (hfpatch.position.registry `Option.kind`), the placements', the
attention temperatures' and the per-layer schemes' options (their registries), the command lines' flags (read off
their parsers' actions), the search's options (`SearchOptions`' fields: their types and declarations), the fields
of a results file (read off a real run). Each option gets the bad values of its form: wrong types (dict, list, str,
bytes, bool, None where no default is meant, a float for an integer), empty, negative, zero, huge (1e308, 2**63),
NaN and inf; a path gets a missing path, a folder where a file is meant, a file where a folder is meant, a path
under a file, a read-only folder, an empty file, a binary file, a file of another kind and the empty string.

What passes:
- from Python, a ValueError or TypeError whose message is one line and names what was wrong (the parameter, the
  path or the value); the model given is exactly as it was (tests/conftest.py `fingerprint`), in its own modes;
- from the command line, exit code 2 and exactly one line on stderr, starting with the command's prog ("hfpatch:
  error:", "hfpatch patch: error:" for a flag argparse refuses, "hfpatch eval ppl: error:", "hfpatch search:
  error:"), naming what was wrong; a progress bar or a one-line warning (`PROG: warning: ...`) the command wrote
  before it met the error is not a line of it, a Python warning in its own form (with the line of code) is;
- for a probe (a value of the right type whose range some options accept: -1 for a signed option, 2**63 for a
  count), that refusal, or a run that works: a patched model gives finite logits and `unpatch` gives it back.
Anything else fails: a traceback, an error of another type, a message of several lines or naming nothing, a value
accepted silently, a hang (each case has a deadline).
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import dataclasses
import errno
import functools
import inspect
import io
import json
import os
import re
import shutil
import signal
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_same_fingerprint, fingerprint

import hfpatch
from hfpatch import tiny
from hfpatch.adapters import adapter_for
from hfpatch.introspect import position_limit
from hfpatch.norm.placement import PLACEMENTS
from hfpatch.position.attention.temperature import TEMPERATURES
from hfpatch.position.registry import LAYER_SCHEMES, SCHEMES, unavailable

NAN, INF = float("nan"), float("inf")
DEADLINE_S = 60  # a case still running after this hangs (a loop over 2**63 trials, a key of 2**63 digits)


# ------------------------------------------------------------------------------------------ the bad values, by form


@dataclass(frozen=True)
class Bad:
    """A bad value and its label (in the case's id). `probe`: a value of the right type whose range some options of
    the form accept: refused in one line, or accepted and working. `names`: what the error may name besides the
    parameter (an option inside the value)."""

    label: str
    value: Any
    probe: bool = False
    names: tuple[str, ...] = ()


WRONG_TYPES = [Bad("dict", {"a": 1}), Bad("list", [1.0]), Bad("str", "abc"), Bad("bytes", b"\x00"), Bad("bool", True)]
NUMBER = [*WRONG_TYPES, Bad("nan", NAN), Bad("inf", INF), Bad("-inf", -INF), Bad("negative", -1.0, True),
          Bad("zero", 0.0, True), Bad("1e308", 1e308, True), Bad("2**63", 2 ** 63, True), Bad("1e-308", 1e-308, True)]
INTEGER = [*WRONG_TYPES, Bad("float", 2.5), Bad("nan", NAN), Bad("inf", INF), Bad("1e308", 1e308),
           Bad("negative", -1, True), Bad("zero", 0, True), Bad("2**63", 2 ** 63, True),
           Bad("-2**63", -(2 ** 63), True), Bad("float-whole", 4.0, True)]
FLAG = [Bad("str", "yes"), Bad("int", 1), Bad("dict", {}), Bad("list", []), Bad("nan", NAN)]
NUMBERS = [Bad("str", "abc"), Bad("number", 3.0), Bad("dict", {}), Bad("empty", []), Bad("nan", [NAN]),
           Bad("inf", [INF]), Bad("strs", ["a"]), Bad("bools", [True]), Bad("negative", [-1.0]), Bad("zero", [0.0]),
           Bad("1e308", [1e308], True), Bad("one", [1.0])]
NAMES = [Bad("empty", []), Bad("int", 5), Bad("ints", [5]), Bad("dict", {}), Bad("bool", True)]
CHOICE = [*WRONG_TYPES, Bad("empty", ""), Bad("blank", " "), Bad("unknown", "bogus"), Bad("int", 5)]
# a setting read as text: what no text setting takes, and numbers and lists, which some take (lengths, depths)
TEXT = [Bad("dict", {"a": 1}), Bad("list", [1.0], True), Bad("bytes", b"\x00"), Bad("bool", True), Bad("empty", ""),
        Bad("blank", " "), Bad("word", "abc"), Bad("comma", ","), Bad("negative", "-1", True), Bad("zero", "0", True),
        Bad("nan", "nan"), Bad("inf", "inf"), Bad("1e308", "1e308", True), Bad("2**63", str(2 ** 63), True)]
# layers= (per-layer positions): the selectors of a per-layer scheme
LAYER_SELECTORS = [Bad("empty", {}), Bad("str", "abc"), Bad("int", 5), Bad("none-group", None),
                   Bad("unknown-scheme", "bogus"), Bad("every0", "every0"), Bad("every-1", "every-1"),
                   Bad("every-huge", "every" + "9" * 30, True), Bad("index-1e308", [1e308]),
                   Bad("index-2**63", [2 ** 63]), Bad("index-nan", [NAN]), Bad("index-negative", [-1]),
                   Bad("index-past-the-layers", [99]), Bad("index-bool", [True]), Bad("empty-list", [])]
BY_KIND = {"number": NUMBER, "integer": INTEGER, "flag": FLAG, "numbers": NUMBERS, "names": NAMES}

# The same forms as a command line gives them: text
NUMBER_TEXT = [Bad("word", "abc"), Bad("empty", ""), Bad("nan", "nan"), Bad("inf", "inf"), Bad("-inf", "-inf"),
               Bad("negative", "-1", True), Bad("zero", "0", True), Bad("1e308", "1e308", True),
               Bad("1e999", "1e999"), Bad("1e-308", "1e-308", True), Bad("list", "[1]")]
INTEGER_TEXT = [Bad("word", "abc"), Bad("empty", ""), Bad("float", "2.5"), Bad("nan", "nan"), Bad("inf", "inf"),
                Bad("negative", "-1", True), Bad("zero", "0", True), Bad("1e308", "1e308"),
                Bad("2**63", str(2 ** 63), True), Bad("list", "[1]")]
FLAG_TEXT = [Bad("word", "maybe"), Bad("empty", ""), Bad("number", "2"), Bad("nan", "nan")]
NUMBERS_TEXT = [Bad("word", "abc"), Bad("empty", ""), Bad("empty-list", "[]"), Bad("nan", "[NaN]"),
                Bad("inf", "[Infinity]"), Bad("negative", "-1"), Bad("zero", "0"), Bad("strs", '["a"]'),
                Bad("bools", "[true]"), Bad("object", "{}"), Bad("comma-word", "1,abc"), Bad("one", "1"),
                Bad("1e308", "1e308", True)]
NAMES_TEXT = [Bad("empty", ""), Bad("unknown", "no_such_layer_type", True)]
CHOICE_TEXT = [Bad("empty", ""), Bad("unknown", "bogus"), Bad("number", "5")]
NO_VALUE_TEXT = [Bad("given-a-value", "=yes")]  # a flag that takes no value, given one
TEXT_TEXT = [b for b in TEXT if isinstance(b.value, str)]
TEXT_BY_KIND = {"number": NUMBER_TEXT, "integer": INTEGER_TEXT, "flag": FLAG_TEXT, "numbers": NUMBERS_TEXT,
                "names": NAMES_TEXT}

# The bad paths, by the role of the parameter that takes them (made in the test's folder by `Paths`)
INPUT_FILE = ("missing", "folder", "empty-file", "binary-file", "empty-string", "under-a-file")
MODEL_INPUT = ("missing", "empty-folder", "folder-of-other-files", "text-file", "binary-file", "fake-gguf",
               "empty-string", "under-a-file")
OUTPUT_FOLDER = ("a-file", "under-a-file", "read-only", "empty-string")


# ---------------------------------------------------------------------------------------------------- paths


@dataclass(frozen=True)
class PathOf:
    """A path of a kind, in a case's arguments: made by `Paths` when the case runs ("model", "text" and "out" are
    the good ones: the saved tiny model, a text file, a new folder; the others are INPUT_FILE's, MODEL_INPUT's and
    OUTPUT_FOLDER's bad ones)."""

    kind: str


@dataclass(frozen=True)
class FileHolding:
    """A file holding this text, in a case's arguments (a spec file, ...)."""

    text: str


class ReadOnly:
    """A folder nothing can be written in. Where permissions stop the user (not root), it is chmod 0o555 (until
    `release`); for root, whom permissions do not stop, the calls that write (open for writing, mkdir, rename,
    replace, unlink, rmdir) fail with EACCES for paths inside it, as they would in a read-only folder."""

    WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def __init__(self, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.folder = folder.resolve()
        folder.chmod(0o555)
        try:
            (folder / ".probe").touch()
        except PermissionError:
            return  # permissions hold
        (folder / ".probe").unlink()
        folder.chmod(0o755)
        self._simulate(monkeypatch)

    def release(self) -> None:
        self.folder.chmod(0o755)

    def inside(self, path: Any) -> bool:
        if isinstance(path, int):  # a file descriptor
            return False
        full = Path(os.fsdecode(path)).absolute()
        return full == self.folder or self.folder in full.parents

    def refuse(self, path: Any) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))

    def _simulate(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real_open, real_os_open = builtins.open, os.open

        def open_(file, mode="r", *args, **kwargs):
            if any(c in mode for c in "wax+") and self.inside(file):
                self.refuse(file)
            return real_open(file, mode, *args, **kwargs)

        def os_open(path, flags, *args, **kwargs):
            if flags & self.WRITE_FLAGS and self.inside(path):
                self.refuse(path)
            return real_os_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", open_)
        monkeypatch.setattr(io, "open", open_)  # pathlib's
        monkeypatch.setattr(os, "open", os_open)
        for name, paths in (("mkdir", 1), ("unlink", 1), ("remove", 1), ("rmdir", 1), ("rename", 2), ("replace", 2)):
            monkeypatch.setattr(os, name, self._guarded(getattr(os, name), paths))

    def _guarded(self, real: Callable, paths: int) -> Callable:
        def call(*args, **kwargs):
            for path in args[:paths]:
                if self.inside(path):
                    self.refuse(path)
            return real(*args, **kwargs)

        return call


@dataclass
class Paths:
    """The paths of each kind, made on first use in `root`; `saved` holds the tiny model and the text file."""

    root: Path
    saved: Path
    monkeypatch: pytest.MonkeyPatch
    made: dict = field(default_factory=dict)
    read_only: list = field(default_factory=list)

    def __call__(self, kind: str) -> str:
        if kind not in self.made:
            self.made[kind] = self._make(kind)
        return self.made[kind]

    def resolve(self, value: Any) -> Any:
        """`value` with its PathOf and FileHolding made (in lists, tuples and dicts too)."""
        if isinstance(value, PathOf):
            return self(value.kind)
        if isinstance(value, FileHolding):
            path = self.root / "given-file"
            path.write_bytes(value.text.encode("utf-8", "surrogateescape"))
            return str(path)
        if isinstance(value, (list, tuple)):
            return type(value)(self.resolve(v) for v in value)
        if isinstance(value, dict):
            return {k: self.resolve(v) for k, v in value.items()}
        return value

    def names(self, names: tuple) -> tuple[str, ...]:
        """The names an error may give, with a path as it is (the empty one as '')."""
        return tuple(self.resolve(n) or "''" if isinstance(n, PathOf) else n for n in names)

    def make_read_only(self, folder: Path) -> None:
        self.read_only.append(ReadOnly(folder, self.monkeypatch))

    def _make(self, kind: str) -> str:
        base = self.root / "paths"
        base.mkdir(exist_ok=True)
        path = base / kind
        good = {"model": self.saved / "model", "text": self.saved / "text.txt", "out": self.root / "out"}
        if kind in good:
            return str(good[kind])
        if kind == "missing":
            return str(base / "nothing" / "here")
        if kind == "empty-string":
            return ""
        if kind == "under-a-file":
            return str(Path(self("a-file")) / "inside")
        if kind in ("folder", "empty-folder"):
            path.mkdir()
        elif kind == "folder-of-other-files":
            path.mkdir()
            (path / "notes.txt").write_text("not a model\n")
        elif kind in ("a-file", "text-file"):
            path.write_text("some text, not what was asked for\n")
        elif kind == "empty-file":
            path.write_bytes(b"")
        elif kind == "binary-file":
            path.write_bytes(bytes(range(256)) * 4)
        elif kind == "fake-gguf":
            path = base / "model.gguf"
            path.write_bytes(b"GGUF" + bytes(range(256)))
        elif kind == "read-only":
            path.mkdir()
            self.make_read_only(path)
            return str(path / "out")
        else:
            raise AssertionError(f"no path of kind {kind}")
        return str(path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A tiny model and its tokenizer saved in a folder, and a text file: what the commands load."""
    root = tmp_path_factory.mktemp("fuzz-model")
    tiny.save_sized(root / "model")
    (root / "text.txt").write_text(tiny.char_text(4000, seed=1), encoding="utf-8")
    return root


@pytest.fixture
def paths(tmp_path, saved, monkeypatch) -> Iterator[Paths]:
    made = Paths(tmp_path, saved, monkeypatch)
    yield made
    for folder in made.read_only:
        folder.release()


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Nothing reaches a hub; nothing is written outside the test's folder (the tokenization cache, a relative
    --out)."""
    monkeypatch.setenv("HFPATCH_CACHE", str(tmp_path / "cache"))
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.chdir(tmp_path)


# ------------------------------------------------------------------------------------------------ what passes


class Deadline(BaseException):  # (not an Exception: no `except Exception` in the code under test swallows it)
    pass


@contextlib.contextmanager
def deadline(seconds: int = DEADLINE_S) -> Iterator[None]:
    """The case fails (Deadline) past `seconds`, instead of hanging the suite."""
    def expired(signum, frame):
        raise Deadline(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _variants(name: str) -> set[str]:
    """A parameter's names in messages: target_length, target-length, target length; lengths as length."""
    bare = name.strip("-")
    out = {bare, bare.replace("_", "-"), bare.replace("-", "_"), bare.replace("_", " ")}
    return out | {v[:-1] for v in out if v.endswith("s") and len(v) > 4}


def named(message: str, names: tuple[str, ...], value: Any = None) -> bool:
    """Whether `message` names one of `names` (any case; `_`, `-` or a space), or the text value given (quoted, or
    as it is where it is long enough to be told apart)."""
    wanted = {v.lower() for n in names for v in _variants(str(n)) if v}
    if isinstance(value, str) and value.strip("'\"").strip():
        wanted |= {repr(value).lower()} | ({value.lower()} if len(value) >= 3 else set())
    return any(w in message.lower() for w in wanted)


def _traceback(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__))


def python_call(call: Callable[[], Any], names: tuple[str, ...], probe: bool, value: Any = None) -> Any:
    """Run `call`: a ValueError or TypeError of one line naming one of `names` (or `value`) passes, and returns
    None; for a probe, a return passes too, and returns the result (for the caller to check it works); anything
    else fails."""
    try:
        with deadline():
            result = call()
    except (ValueError, TypeError) as e:
        message = str(e).strip()
        assert message and "\n" not in message, f"a message of {len(message.splitlines())} lines: {message!r}"
        assert named(message, names, value), f"the message names none of {names} nor {value!r}: {message!r}"
        return None
    except BaseException as e:  # any other error is the failure this test looks for
        pytest.fail(f"not a one-line error but a traceback:\n{_traceback(e)}")
    if not probe:
        pytest.fail(f"accepted: returned {type(result).__name__} instead of refusing")
    return result


# A progress bar's line (transformers' "Loading weights: 100%|███| 21/21 [...]", tqdm's): what the command did
# before it met the error, not a line of the error
PROGRESS = re.compile(r"\d+%\|.*\|")


@contextlib.contextmanager
def warnings_on_stderr() -> Iterator[None]:
    """Python warnings shown on stderr as a command run from a shell shows them (Python's default filters, each
    warning written by warnings.formatwarning), instead of recorded by pytest: they are lines the user sees."""
    def show(message, category, filename, lineno, file=None, line=None):
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.simplefilter("always")
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        warnings.showwarning = show
        yield


def cli_call(capsys, argv: list[str], progs: tuple[str, ...], names: tuple[str, ...], probe: bool,
             value: Any = None) -> int:
    """Run `hfpatch ARGV` in this process: exit 2 with exactly one line on stderr, `PROG: error: ...` (one of
    `progs`) naming one of `names` (or `value`), passes; for a probe, exit 0 passes too. Besides the error, stderr
    may hold progress bars and the command's warnings (`PROG: warning: ...`, one line each), nothing else: a Python
    warning in its own form (file, line, the line of code) fails. Returns the exit code."""
    from hfpatch.cli import main

    capsys.readouterr()
    try:
        with deadline(), warnings_on_stderr():
            code = main(argv)
    except BaseException as e:  # the command must not raise at all
        pytest.fail(f"`hfpatch {' '.join(argv)}` raised instead of exiting 2:\n{_traceback(e)}")
    err = capsys.readouterr().err
    if code == 0 and probe:
        return code
    assert "Traceback" not in err, err
    assert code == 2, f"exit code {code}, stderr:\n{err}"
    said = tuple(f"{p}: warning: " for p in progs)  # the command's warnings, one line each, are not the error's
    lines = [line for line in err.strip().splitlines() if not PROGRESS.search(line) and not line.startswith(said)]
    assert len(lines) == 1, f"{len(lines)} lines on stderr:\n{err}"
    assert lines[0].startswith(tuple(f"{p}: error: " for p in progs)), lines[0]
    assert named(lines[0], names, value), f"the error names none of {names} nor {value!r}: {lines[0]}"
    return code


def param(target: str, label: str, *values: Any, known: dict[str, str] | None = None) -> Any:
    """A case: its id is TARGET:LABEL; `known` marks it as an expected failure where its id matches a pattern."""
    case = f"{target}:{label}"
    why = next((why for pattern, why in (known or {}).items() if re.fullmatch(pattern, case)), None)
    return pytest.param(*values, id=case, marks=[pytest.mark.xfail(reason=why, strict=True)] if why else [])


def flag_of(action: argparse.Action) -> str:
    return max(action.option_strings, key=len)


def with_value(flag: str, bad: Bad | PathOf) -> list:
    """FLAG VALUE; FLAG=VALUE where the value starts with a dash (argparse would read it as a flag), FLAG=yes for
    a flag that takes no value."""
    if isinstance(bad, PathOf):
        return [flag, bad]
    if bad.value.startswith("="):
        return [flag + bad.value]
    return [f"{flag}={bad.value}"] if bad.value.startswith("-") else [flag, bad.value]


def argv_of(settings: dict[str, Any]) -> list:
    """Settings as flags: --key value, --key v1 v2 for a list, --key for True, --no-key for False."""
    argv: list = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv += [flag] if value else ["--no-" + key.replace("_", "-")]
        else:
            argv += [flag, *(value if isinstance(value, list) else [value])]
    return [a if isinstance(a, PathOf) else str(a) for a in argv]


# ---------------------------------------------------------------------------------------------- models kept whole


class Models:
    """One model per family, reused by the cases: each case checks that the model is exactly as it was after it
    (its patch undone where it was an accepted probe), so the next case gets it whole; one left changed is
    rebuilt."""

    def __init__(self, build: Callable[[str], torch.nn.Module]) -> None:
        self.build = build
        self.held: dict[str, tuple[torch.nn.Module, Any]] = {}

    @contextlib.contextmanager
    def whole(self, family: str) -> Iterator[torch.nn.Module]:
        from hfpatch.evaluate.common import live_spec, restore

        if family not in self.held:
            model = self.build(family)
            self.held[family] = (model, fingerprint(model))
        model, before = self.held[family]
        spec, modes = live_spec(model), [m.training for m in model.modules()]
        try:
            yield model
            restore(model, spec)
            assert_same_fingerprint(before, fingerprint(model))
            assert [m.training for m in model.modules()] == modes, "the modules' train/eval modes changed"
        except BaseException:
            self.held.pop(family, None)
            raise


@pytest.fixture(scope="module")
def models() -> Models:
    return Models(lambda family: tiny.sized_model(family).eval())


def runs_finite(model: torch.nn.Module) -> None:
    """An accepted patch gives a model that runs: finite logits over twice the trained window (or its length limit,
    if shorter)."""
    length = min(position_limit(model) or 2 * tiny.WINDOW, 2 * tiny.WINDOW)
    ids = torch.randint(3, tiny.SIZED_VOCAB, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all(), f"the accepted patch gives non-finite logits: {hfpatch.describe(model)}"


# ------------------------------------------------------------------------------------------------- hfpatch.patch

FAMILIES_TRIED = ("llama", "gpt2")  # a scheme is fuzzed on the first of these it applies to


@functools.cache
def _adapter(family: str) -> Any:
    return adapter_for(tiny.sized_model(family))


def family_for(scheme: str) -> str:
    return next((f for f in FAMILIES_TRIED if unavailable(scheme, _adapter(f), {}) is None), FAMILIES_TRIED[0])


def scheme_base(scheme: str) -> dict:
    """The keywords a scheme needs besides the option fuzzed: its factor where it requires one, LongRoPE's lists."""
    base: dict = {"position": scheme}
    if SCHEMES[scheme].factor == "required":
        base["factor"] = 2.0
    if scheme == "longrope":
        pairs = tiny.SIZED["llama"]["hidden_size"] // tiny.SIZED["llama"]["num_attention_heads"] // 2
        base.update(short_factor=[1.0] * pairs, long_factor=[2.0] * pairs)
    return base


# hfpatch.patch's own keywords (a test holds them equal to its signature): their bad values, what they go with
PATCH_KEYWORDS: dict[str, tuple[list[Bad], dict]] = {
    "position": ([*CHOICE, Bad("spec-string", "yarn:4")], {}),
    "factor": (NUMBER, {"position": "yarn"}),
    "norm": (CHOICE, {}),
    "placement": (CHOICE, {}),
    "exact": (FLAG, {"norm": "rmsnorm"}),
    "attention_temperature": ([*CHOICE, Bad("dict-without-kind", {"window": 4}), Bad("kind-int", {"kind": 5}),
                               Bad("unknown-option", {"kind": "logn", "bogus": 1})], {}),
}
MISUSED = [  # keywords where they do not belong: (label, keywords, what the error must name)
    ("unknown-keyword", {"bogus": 1}, "bogus"),
    ("exact-without-norm", {"exact": True}, "exact"),
    ("factor-without-position", {"factor": 2.0}, "factor"),
    ("option-of-another-scheme", {"position": "ntk", "factor": 2.0, "beta_fast": 32.0}, "beta_fast"),
]
NOT_MODELS = [Bad("none", None), Bad("str", "llama"), Bad("int", 5), Bad("dict", {}),
              Bad("linear", torch.nn.Linear(2, 2))]


def layer_values() -> list[Bad]:
    """layers=: bad forms of the whole, then each per-layer scheme's bad selectors and option values."""
    out = [Bad("empty", {}), Bad("str", "abc"), Bad("list", [1]), Bad("int", 5),
           Bad("unknown-scheme", {"bogus": "every2"}), Bad("key-int", {5: "every2"})]
    for name, rec in LAYER_SCHEMES.items():
        out += [Bad(f"{name}@{bad.label}", {name: bad.value}, bad.probe) for bad in LAYER_SELECTORS]
        for option in rec.options:
            out += [Bad(f"{name}.{option}={bad.label}", {name: {"layers": [0], option: bad.value}}, bad.probe)
                    for bad in NUMBER]
    return out


def patch_cases() -> list:
    """(family, keywords, names, probe): patch()'s keywords; every option of every position scheme, given with the
    scheme (its form from the registry's Option.kind); the placements' and attention temperatures' options."""
    cases = [param("patch", f"{name}={bad.label}", "llama", {**context, name: bad.value}, (name,), bad.probe)
             for name, (values, context) in PATCH_KEYWORDS.items() for bad in values]
    cases += [param("patch", label, "llama", kwargs, (name,), False) for label, kwargs, name in MISUSED]
    for scheme, rec in SCHEMES.items():
        base, family = scheme_base(scheme), family_for(scheme)
        forms = {name: option.kind for name, option in rec.options.items()}
        if rec.factor != "none":
            forms["factor"] = "number"
        for option, kind in forms.items():
            for bad in layer_values() if kind == "layers" else BY_KIND[kind]:
                cases.append(param("patch", f"{scheme}.{option}={bad.label}", family, {**base, option: bad.value},
                                   (option,), bad.probe))
    for kind, rec in PLACEMENTS.items():
        cases += [param("patch", f"placement-{kind}.{option}={bad.label}", "llama",
                        {"placement": kind, option: bad.value}, (option,), bad.probe)
                  for option in rec.options for bad in NUMBER]
    for kind, rec in TEMPERATURES.items():
        cases += [param("patch", f"temperature-{kind}.{option}={bad.label}", "llama",
                        {"attention_temperature": {"kind": kind, option: bad.value}}, (option,), bad.probe)
                  for option in rec.options for bad in [*NUMBER, Bad("float", 2.5, True)]]
    return cases


@pytest.mark.parametrize(("family", "kwargs", "names", "probe"), patch_cases())
def test_patch(models, family, kwargs, names, probe):
    with models.whole(family) as model:
        if python_call(lambda: hfpatch.patch(model, **kwargs), names, probe) is not None:
            runs_finite(model)


@pytest.mark.parametrize("bad", [param("patch", f"model={b.label}", b) for b in NOT_MODELS])
def test_patch_something_that_is_not_a_model(bad):
    python_call(lambda: hfpatch.patch(bad.value, position="yarn", factor=2.0), ("model",), False)


# --------------------------------------------------------------------------------------------- hfpatch patch

SPEC_FILE_CONTENTS = [Bad("json-list", "[1, 2]"), Bad("json-null", "null"), Bad("empty-object", "{}"),
                      Bad("not-json", "position: yarn"), Bad("binary", "\udcff\udcfe")]
LAYERS_TEXT = [Bad("no-at", "nope"), Bad("no-layers", "nope@"), Bad("no-scheme", "@every2"),
               Bad("unknown-scheme", "bogus@every2"), Bad("every0", "nope@every0"), Bad("every-1", "nope@every-1"),
               Bad("index-1e308", "nope@[1e308]"), Bad("index-negative", "nope@[-1]"), Bad("index-past", "nope@[99]"),
               Bad("bad-json", "nope@[1,"), Bad("option-without-value", "p-rope@[0]:keep"),
               Bad("keep-nan", "p-rope@[0]:keep=NaN"), Bad("keep-2", "p-rope@[0]:keep=2"),
               Bad("unknown-option", "nope@[0]:bogus=1")]
YARN = ["--position", "yarn", "--factor", "2"]


def subparser(command: str) -> argparse.ArgumentParser:
    from hfpatch.cli import build_parser

    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def text_values(action: argparse.Action) -> list[Bad]:
    """A flag's bad texts, by its action: a value for a flag that takes none, other choices, or its type's form
    (float, int, the patch command's own parsers; several words)."""
    from hfpatch import cli

    if action.nargs == 0:
        return NO_VALUE_TEXT
    if action.choices is not None:
        return CHOICE_TEXT
    forms = {float: "number", int: "integer", cli._boolean: "flag", cli._numbers: "numbers", None: "names"}
    kind = forms.get(action.type)  # type: ignore[arg-type]
    if kind is None or (kind == "names" and action.nargs != "+"):
        raise AssertionError(f"{flag_of(action)}: no bad values for its form; add them to the fuzz test")
    return TEXT_BY_KIND[kind]


def scheme_argv(scheme: str) -> list[str]:
    """The flags a scheme needs besides the option fuzzed (scheme_base's)."""
    return [a for key, value in scheme_base(scheme).items()
            for a in (f"--{key.replace('_', '-')}", json.dumps(value) if isinstance(value, list) else str(value))]


def temperature_texts() -> list[Bad]:
    """--attention-temperature KIND:OPTION=VALUE: each kind's options (the registry's), with bad numbers."""
    out = [Bad("no-kind", ":window=4"), Bad("option-without-value", "logn:window"), Bad("unknown-option", "logn:x=1")]
    for kind, rec in TEMPERATURES.items():
        out += [Bad(f"{kind}.{option}={bad.label}", f"{kind}:{option}={bad.value}", bad.probe, (option,))
                for option in rec.options for bad in [*NUMBER_TEXT, Bad("float", "2.5", True)] if bad.value]
    return [*CHOICE_TEXT, *out]


def opt_texts() -> list[Bad]:
    """--opt KEY=VALUE: malformed, unknown, and the factor's bad numbers."""
    return [Bad("no-equals", "factor"), Bad("no-key", "=2"), Bad("unknown-key", "bogus=1", names=("bogus",)),
            *(Bad(f"factor={bad.label}", f"factor={bad.value}", bad.probe, ("factor",)) for bad in NUMBER_TEXT
              if bad.value)]


def _json_able(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, bytes)


def patch_flag_cases(action: argparse.Action, scheme_owner: dict[str, str]) -> list:
    """(argv after `patch`, names, probe) for one flag of `hfpatch patch`, with what the flag goes with."""
    dest, flag = action.dest, flag_of(action)
    model_out = [PathOf("model"), "--out", PathOf("out")]
    if dest == "out":
        return [param("hfpatch-patch", f"--out={kind}", [PathOf("model"), "--out", PathOf(kind), *YARN],
                      ("out", PathOf(kind)), False) for kind in OUTPUT_FOLDER]
    if dest == "spec_file":
        files = [(kind, PathOf(kind), ("spec-file", PathOf(kind)), False) for kind in INPUT_FILE]
        files += [(f"holding-{b.label}", FileHolding(b.value), ("spec-file",), False) for b in SPEC_FILE_CONTENTS]
        files += [(f"holding-{name}={b.label}", FileHolding(json.dumps({**context, name: b.value})), (name,),
                   b.probe) for name, (values, context) in PATCH_KEYWORDS.items() for b in values
                  if _json_able(b.value)]
        return [param("hfpatch-patch", f"--spec-file={label}", [*model_out, flag, file], names, probe)
                for label, file, names, probe in files]
    if dest == "calibrate":
        return [param("hfpatch-patch", f"--calibrate={kind}", [*model_out, "--norm", "dyt", flag, PathOf(kind)],
                      ("calibrate", PathOf(kind)), False) for kind in INPUT_FILE]
    own = {"layers": (["--position", "rope"], LAYERS_TEXT, (dest,)),  # flags with their own forms
           "attention_temperature": ([], temperature_texts(), (dest, "temperature")),
           "opt": (YARN, opt_texts(), ("opt", "KEY=VALUE")),
           "position": ([], [*CHOICE_TEXT, Bad("spec-string", "yarn:4")], (dest,))}
    context, values, names = own.get(dest) or (patch_context(dest, scheme_owner), text_values(action), (dest,))
    return [param("hfpatch-patch", f"{flag}={bad.label}", [*model_out, *context, *with_value(flag, bad)],
                  (*names, *bad.names), bad.probe) for bad in values]


def patch_context(dest: str, scheme_owner: dict[str, str]) -> list:
    """The flags an option of `hfpatch patch` goes with: a scheme that takes it, the patch it belongs to."""
    if dest in scheme_owner:
        return scheme_argv(scheme_owner[dest])
    if dest in hfpatch.spec.all_placement_options():
        return ["--placement", next(k for k, rec in PLACEMENTS.items() if dest in rec.options)]
    return {"factor": ["--position", "yarn"], "norm": [], "placement": [], "exact": ["--norm", "rmsnorm"],
            "calibrate_tokens": ["--norm", "dyt", "--calibrate", PathOf("text")]}.get(dest, YARN)


def patch_cli_cases() -> list:
    """Every argument of `hfpatch patch` (its parser's actions; the scheme options with a scheme that takes them,
    as hfpatch.patch_options declares them)."""
    from hfpatch import patch_options

    owners = {name: takers[0] for name, (_, _, takers) in patch_options.offered()["SCHEME_OPTIONS"].items()}
    cases = []
    for action in subparser("patch")._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if not action.option_strings:  # the model
            cases += [param("hfpatch-patch", f"MODEL={kind}", [PathOf(kind), "--out", PathOf("out"), *YARN],
                            ("model", PathOf(kind)), False) for kind in MODEL_INPUT]
        else:
            cases += patch_flag_cases(action, owners)
    return cases


@pytest.mark.parametrize(("argv", "names", "probe"), patch_cli_cases())
def test_hfpatch_patch(capsys, paths, argv, names, probe):
    cli_call(capsys, ["patch", *paths.resolve(argv)], ("hfpatch", "hfpatch patch"), paths.names(names), probe)


# ---------------------------------------------------------------------------------------------- hfpatch.calibrate

BATCH = torch.tensor([[5, 6, 7, 8]])
BATCHES = [
    *WRONG_TYPES, Bad("int", 5), Bad("float", 1.5), Bad("nan", NAN), Bad("empty-list", []),
    Bad("float-ids", BATCH.float()), Bad("nan-ids", torch.full((1, 4), NAN)), Bad("bool-ids", BATCH > 6),
    Bad("uint8-ids", BATCH.to(torch.uint8)), Bad("int16-ids", BATCH.to(torch.int16)),
    Bad("negative-ids", -BATCH), Bad("ids-at-the-vocabulary", BATCH + tiny.SIZED_VOCAB),
    Bad("ids-2**63-1", torch.full((1, 4), 2 ** 63 - 1)), Bad("1-d", BATCH[0]), Bad("3-d", BATCH[None]),
    Bad("0-d", BATCH[0, 0]), Bad("no-tokens", BATCH[:, :0]), Bad("one-token", BATCH[:, :1]),
    Bad("list-holding-a-bad-tensor", [BATCH, -BATCH]), Bad("list-of-lists", [[5, 6, 7]]),
    Bad("dict-of-a-list", {"input_ids": [[5, 6, 7]]}), Bad("dict-without-ids", {"attention_mask": BATCH}),
    Bad("mask-of-another-shape", {"input_ids": BATCH, "attention_mask": torch.ones(1, 9, dtype=torch.long)}),
    Bad("mask-a-string", {"input_ids": BATCH, "attention_mask": "abc"}),
    Bad("mask-nan", {"input_ids": BATCH, "attention_mask": torch.full((1, 4), NAN)}),
    Bad("generator-of-a-bad-tensor", "generator"),
]


def with_dyt(family: str) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DyT is never function-preserving: calibrating is what it asks for
        return hfpatch.patch(tiny.sized_model(family).eval(), norm="dyt")


@pytest.fixture(scope="module")
def calibratable() -> Models:
    """Tiny models with norm='dyt' (what calibrate fits), held whole between the cases."""
    return Models(with_dyt)


@pytest.mark.parametrize("bad", [param("calibrate", f"batches={b.label}", b) for b in BATCHES])
def test_calibrate(calibratable, bad):
    value = (x for x in [BATCH, -BATCH]) if bad.value == "generator" else bad.value
    with calibratable.whole("llama") as model:
        python_call(lambda: hfpatch.calibrate(model, value), ("batches", "input_ids", "attention_mask"), bad.probe)


@pytest.mark.parametrize("bad", [param("calibrate", f"model={b.label}", b) for b in NOT_MODELS])
def test_calibrate_something_that_is_not_a_model(bad):
    python_call(lambda: hfpatch.calibrate(bad.value, BATCH), ("model",), False)


def test_calibrate_a_model_with_nothing_to_calibrate(models):
    with models.whole("llama") as model:
        python_call(lambda: hfpatch.calibrate(model, BATCH), ("nothing to calibrate",), False)


# ----------------------------------------------------------------------------------- hfpatch.evaluate, hfpatch eval

# The settings each evaluation is fuzzed with (the others at these): a run of a few tenths of a second on the tiny
# model, so that a bad value that is accepted runs to the end. Every evaluation needs an entry (a test checks it).
EVAL_BASE: dict[str, dict[str, Any]] = {
    "ppl": {"lengths": "32", "text_files": [PathOf("text")], "tokens_per_doc": "64", "max_docs": "1"},
    "passkey": {"lengths": "300", "depths": "0.5", "trials": 1, "new_tokens": 6, "key_digits": 2},
    "ruler": {"lengths": "600", "samples": 1, "tasks": "niah_single_1", "text_files": [PathOf("text")]},
    "niah": {"lengths": "300", "depths": "0.5", "trials": 1, "new_tokens": 4, "text_files": [PathOf("text")]},
}
EVAL_COMMON = {"patches": "none", "no_plot": True}
# settings that take a path, by role (the others' bad values are read off their parser: flag, integer, choice, text)
EVAL_PATHS = {"out": OUTPUT_FOLDER, "text_files": INPUT_FILE, "needles": INPUT_FILE, "engine_python": INPUT_FILE}
# a setting of several paths, and of one (which takes a number as its text, as the command line does)
PATH_LISTS = [Bad("empty-list", []), Bad("int", 5), Bad("dict", {"a": 1}), Bad("bytes", b"\x00")]
PATH_VALUES = [Bad("dict", {"a": 1}), Bad("list", [1.0], True), Bad("bytes", b"\x00"), Bad("bool", True),
               Bad("int", 5, True)]


def eval_settings(name: str) -> list[tuple[argparse.Action, Any]]:
    """Each setting of evaluation `name` (its parser's actions but --model and --help) and its form: path kinds, or
    the Python bad values of what the action declares."""
    from hfpatch.evaluate import evaluation
    from hfpatch.evaluate.definition import build_parser

    out: list[tuple[argparse.Action, Any]] = []
    for action in build_parser(evaluation(name))._actions:
        if isinstance(action, argparse._HelpAction) or action.dest == "model":
            continue
        if action.dest in EVAL_PATHS or action.metavar == "PATH":
            out.append((action, EVAL_PATHS.get(action.dest, INPUT_FILE)))
        elif action.nargs == 0:
            out.append((action, FLAG))
        elif action.choices is not None:
            out.append((action, CHOICE))
        elif action.type in (int, None):
            out.append((action, INTEGER if action.type is int else TEXT))
        else:
            raise AssertionError(f"{name} {flag_of(action)}: no bad values for its form; add them to the fuzz test")
    return out


def eval_cases() -> list:
    """(evaluation, setting, value, names, probe) for every setting of every evaluation."""
    from hfpatch.evaluate import EVALUATIONS

    cases = []
    for name in EVALUATIONS:
        for action, values in eval_settings(name):
            key, target = action.dest, f"evaluate.run-{name}"
            if isinstance(values, tuple):  # path kinds: a list of them where the setting takes several
                several = action.nargs in ("+", "*")
                cases += [param(target, f"{key}={kind}", name, key, [PathOf(kind)] if several else PathOf(kind),
                                (key, PathOf(kind)), False) for kind in values]
                cases += [param(target, f"{key}={b.label}", name, key, b.value, (key,), b.probe)
                          for b in (PATH_LISTS if several else PATH_VALUES)]
            else:
                cases += [param(target, f"{key}={b.label}", name, key, b.value, (key,), b.probe) for b in values]
    return cases


def eval_cli_cases() -> list:
    """(evaluation, argv of the flag, names, probe) for every flag of every `hfpatch eval NAME`, and --model."""
    from hfpatch.evaluate import EVALUATIONS

    cases = []
    for name in EVALUATIONS:
        target = f"hfpatch-eval-{name}"
        for action, values in eval_settings(name):
            flag, key = flag_of(action), action.dest
            if isinstance(values, tuple):
                cases += [param(target, f"{flag}={kind}", name, key, [flag, PathOf(kind)], (key, PathOf(kind)), False)
                          for kind in values]
            else:
                texts = TEXT_TEXT if values is TEXT else INTEGER_TEXT if values is INTEGER else text_values(action)
                cases += [param(target, f"{flag}={b.label}", name, key, with_value(flag, b), (key, b.value), b.probe)
                          for b in texts]
        cases += [param(target, f"--model={kind}", name, "model", ["--model", PathOf(kind)], ("model", PathOf(kind)),
                        False) for kind in MODEL_INPUT]
    return cases


@pytest.mark.parametrize(("name", "key", "value", "names", "probe"), eval_cases())
def test_evaluate_run(models, paths, name, key, value, names, probe):
    import hfpatch.evaluate as evaluate

    settings = paths.resolve({k: v for k, v in {**EVAL_COMMON, **EVAL_BASE[name]}.items() if k != key})
    value = paths.resolve(value)
    with models.whole("llama") as model:
        python_call(lambda: evaluate.run(name, model, tiny.char_tokenizer(), **{key: value}, **settings),
                    paths.names(names), probe, value)


@pytest.mark.parametrize(("name", "key", "argv", "names", "probe"), eval_cli_cases())
def test_hfpatch_eval(capsys, paths, name, key, argv, names, probe):
    base = {"model": PathOf("model"), "out": PathOf("out"), **EVAL_COMMON, **EVAL_BASE[name]}
    argv = ["eval", name, *argv_of({k: v for k, v in base.items() if k != key}), *argv]
    names = paths.names(names)
    cli_call(capsys, paths.resolve(argv), (f"hfpatch eval {name}",), names[:1], probe, names[1])


@pytest.mark.parametrize("bad", [param("evaluate.run", f"model={b.label}", b) for b in NOT_MODELS[2:]])
def test_evaluate_run_something_that_is_not_a_model(bad):
    import hfpatch.evaluate as evaluate

    python_call(lambda: evaluate.run("ppl", bad.value, tiny.char_tokenizer(), lengths="32"), ("model",), False)


@pytest.mark.parametrize("kind", [param("evaluate.run", f"model={kind}", kind) for kind in MODEL_INPUT])
def test_evaluate_run_a_model_path_that_is_none(paths, kind):
    import hfpatch.evaluate as evaluate

    path, settings = paths(kind), paths.resolve({**EVAL_COMMON, **EVAL_BASE["ppl"]})
    python_call(lambda: evaluate.run("ppl", path, **settings), ("model", path or "''"), False)


@pytest.mark.parametrize("bad", [param("evaluate.run", f"tokenizer={b.label}", b)
                                 for b in [Bad("none", None), *WRONG_TYPES, Bad("int", 5)]])
def test_evaluate_run_a_tokenizer_that_is_none(models, paths, bad):
    import hfpatch.evaluate as evaluate

    settings = paths.resolve({**EVAL_COMMON, **EVAL_BASE["ppl"]})
    with models.whole("llama") as model:
        python_call(lambda: evaluate.run("ppl", model, bad.value, **settings), ("tokenizer",), False)


@pytest.mark.parametrize("bad", [param("evaluate.run", f"name={b.label}", b) for b in CHOICE])
def test_evaluate_run_an_evaluation_that_is_none(models, bad):
    import hfpatch.evaluate as evaluate

    with models.whole("llama") as model:
        python_call(lambda: evaluate.run(bad.value, model, tiny.char_tokenizer()), ("evaluation",), False)


# ------------------------------------------------------------------------------------- hfpatch.search, hfpatch search

# The options each search is fuzzed with (the others at these): two candidates on one sample of 256 tokens of the
# tiny model (window 64), a fraction of a second, so that a bad value that is accepted runs to the end.
SEARCH_BASE: dict[str, Any] = {"target_length": 256, "budget": "2", "population": 2, "parents": 1, "samples": 1,
                               "proxy_tokens": 0, "finalists": 1, "progress": False, "plot": False,
                               "text_files": [PathOf("text")]}
# (no budget of 1e308 or 2**63 candidates, nor of 1e308 s: a budget that large is a search that runs until stopped)
BUDGET_TEXT = [Bad("empty", ""), Bad("word", "abc"), Bad("zero", "0"), Bad("negative", "-1"), Bad("nan", "nan"),
               Bad("inf", "inf"), Bad("zero-seconds", "0s"), Bad("negative-minutes", "-5m"),
               Bad("fraction", "2.5"), Bad("two-times", "1h,2h"), Bad("two-counts", "3,50"), Bad("unit-only", "h")]
FAMILIES_TEXT = [Bad("empty", ""), Bad("unknown", "bogus"), Bad("comma", ","), Bad("one-unknown", "yarn,bogus")]
SEARCH_VALUES = {  # form -> (Python bad values, command-line bad texts); a tuple: path kinds
    "integer": (INTEGER, INTEGER_TEXT), "number": (NUMBER, NUMBER_TEXT), "flag": (FLAG, NO_VALUE_TEXT),
    "length": ([*INTEGER, Bad("window", tiny.WINDOW)], [*INTEGER_TEXT, Bad("window", str(tiny.WINDOW))]),
    "budget": ([*BUDGET_TEXT, *WRONG_TYPES[:2], Bad("int", 5), Bad("none", None)], BUDGET_TEXT),
    "families": ([*FAMILIES_TEXT, Bad("empty-list", []), Bad("ints", [5]), Bad("int", 5), Bad("dict", {})],
                 FAMILIES_TEXT),
    "choice": (CHOICE, CHOICE_TEXT), "text": (TEXT, TEXT_TEXT), "paths": (INPUT_FILE, INPUT_FILE),
    "folder": (OUTPUT_FOLDER, OUTPUT_FOLDER), "model": (MODEL_INPUT, MODEL_INPUT),
}
# Cases that fail today in hfpatch/search (its owner fixes them there): a pattern of case ids -> what goes wrong.
# Each is an expected failure that must fail (strict): once fixed, the case passes, the mark fails, and its line
# here goes.
SEARCH_KNOWN: dict[str, str] = {}


def search_form(f: dataclasses.Field) -> str:
    """The form of a search option, from its declaration (SearchOptions' field: its type, how it is parsed)."""
    d = f.metadata["declared"]
    parse = getattr(d.parse, "__name__", "")
    if parse in ("parse_budget", "parse_families", "parse_length"):
        return parse[len("parse_"):]
    if d.choices is not None:
        return "choice"
    if d.metavar == "PATH":
        return "paths"
    forms = {"int": "integer", "float": "number", "bool": "flag", "str": "text"}
    form = forms.get(str(f.type).replace(" | None", ""))
    if form is None:
        raise AssertionError(f"search option {f.name} ({f.type}): no bad values for its form; add them to this test")
    return {"out": "folder", "model": "model"}.get(f.name, form)


def search_cases() -> list:
    """(option, value, names, probe) for every option search() takes."""
    from hfpatch.search.options import declared

    cases = []
    for f in declared():
        if f.metadata["declared"].python:
            values = SEARCH_VALUES[search_form(f)][0]
            several = f.metadata["declared"].nargs is not None
            kinds = [kind for kind in values if isinstance(kind, str)]
            bads = [b for b in values if isinstance(b, Bad)] + (PATH_LISTS if kinds and several else [])
            cases += [param("search", f"{f.name}={kind}", f.name, [PathOf(kind)] if several else PathOf(kind),
                            (f.name, PathOf(kind)), False, known=SEARCH_KNOWN) for kind in kinds]
            cases += [param("search", f"{f.name}={b.label}", f.name, b.value, (f.name,), b.probe, known=SEARCH_KNOWN)
                      for b in bads]
    return cases


def search_cli_cases() -> list:
    """(option, argv of its flag, names, probe) for every flag of `hfpatch search`."""
    from hfpatch.search.options import declared, flag

    cases = []
    for f in declared():
        if not f.metadata["declared"].cli:
            continue
        given = flag(f) if f.default is not True else "--no-" + f.name.replace("_", "-")
        for bad in SEARCH_VALUES[search_form(f)][1]:
            if isinstance(bad, str):
                cases.append(param("hfpatch-search", f"{flag(f)}={bad}", f.name, [given, PathOf(bad)],
                                   (f.name, PathOf(bad)), False, known=SEARCH_KNOWN))
            else:
                cases.append(param("hfpatch-search", f"{flag(f)}={bad.label}", f.name, with_value(given, bad),
                                   (f.name, bad.value), bad.probe, known=SEARCH_KNOWN))
    return cases


@pytest.mark.parametrize(("key", "value", "names", "probe"), search_cases())
def test_search(models, paths, key, value, names, probe):
    from hfpatch.search import search

    settings = paths.resolve({k: v for k, v in SEARCH_BASE.items() if k != key})
    value = paths.resolve(value)
    with models.whole("llama") as model:
        python_call(lambda: search(model, tiny.char_tokenizer(), **{key: value}, **settings), paths.names(names),
                    probe, value)


@pytest.mark.parametrize(("key", "argv", "names", "probe"), search_cli_cases())
def test_hfpatch_search(capsys, paths, key, argv, names, probe):
    base = {"model": PathOf("model"), "out": PathOf("out"), **SEARCH_BASE}
    argv = ["search", *argv_of({k: v for k, v in base.items() if k != key}), *argv]
    names = paths.names(names)
    cli_call(capsys, paths.resolve(argv), ("hfpatch search",), names[:1], probe, names[1])


# ------------------------------------------------------------------------------------------------------ hfpatch card

JSON_BAD = [Bad("null", None), Bad("object", {}), Bad("list", []), Bad("text", "abc"), Bad("number", 5),
            Bad("nan", NAN), Bad("negative", -1)]
# files of the wrong kind in a run's folder and in the card's: refused in one line, or (probes: files the card does
# not read, or writes anew) a card written
RUN_FILES = [Bad("results-binary", ("results.json", b"\x00\xff\xfe")), Bad("results-empty", ("results.json", b"")),
             Bad("results-list", ("results.json", b"[1, 2]")), Bad("results-null", ("results.json", b"null")),
             Bad("results-kind-only", ("results.json", b'{"kind": "perplexity"}')),
             Bad("results-a-folder", ("results.json", None)), Bad("table-a-folder", ("table.md", None)),
             Bad("table-binary", ("table.md", b"\x00\xff\xfe"), True), Bad("plot-a-folder", ("ppl.png", None), True),
             Bad("plot-not-a-png", ("ppl.png", b"not a png"), True)]
CARD_FILES = [Bad("readme-a-folder", ("README.md", None)), Bad("readme-binary", ("README.md", b"\x00\xff\xfe")),
              Bad("readme-empty", ("README.md", b"")), Bad("config-binary", ("config.json", b"\x00\xff")),
              Bad("plots-a-file", ("hfpatch_plots", b"a file where the plots folder goes"), True)]
# the top-level fields of a results file (a test holds them equal to a real run's, so that a new one is fuzzed)
RESULTS_FIELDS = ("format", "kind", "identity", "model", "settings", "corpus", "cells", "runs", "versions", "started",
                  "updated")


@pytest.fixture(scope="module")
def carded(saved, tmp_path_factory) -> Path:
    """A folder `hfpatch patch` saved (with its card), and a finished `hfpatch eval ppl` run of it, with its plot."""
    from hfpatch.cli import main

    root = tmp_path_factory.mktemp("fuzz-card")
    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as env:
        warnings.simplefilter("ignore")
        env.setenv("HFPATCH_CACHE", str(root / "cache"))  # (the tokenization cache: not the user's)
        assert main(["patch", str(saved / "model"), *YARN, "--out", str(root / "model")]) == 0
        assert main(["eval", "ppl", "--model", str(root / "model"), "--text-files", str(saved / "text.txt"),
                     "--lengths", "32", "--tokens-per-doc", "64", "--patches", "none", "--out", str(root / "run")]) == 0
    return root


def card_cases() -> list:
    """(where, what, probe) for `hfpatch card DIR --results RUN`: bad paths for each, files of the wrong kind in
    each, and each field of the run's results.json given a bad value (a field the card does not need may be
    anything: probes)."""
    folders = ("missing", "empty-folder", "folder-of-other-files", "a-file", "empty-string")
    cases = [param("hfpatch-card", f"DIR={kind}", "folder", kind, False) for kind in (*folders, "read-only")]
    cases += [param("hfpatch-card", f"DIR-holding={b.label}", "folder-file", b.value, b.probe) for b in CARD_FILES]
    cases += [param("hfpatch-card", f"RUN={kind}", "run", kind, False) for kind in folders]
    cases += [param("hfpatch-card", f"RUN-holding={b.label}", "run-file", b.value, b.probe) for b in RUN_FILES]
    cases += [param("hfpatch-card", f"results.{name}={b.label}", "results-field", (name, b.value), True)
              for name in RESULTS_FIELDS for b in JSON_BAD]
    return cases


def _place(folder: Path, name: str, content: bytes | None) -> None:
    """A file holding `content` (None: a folder) at folder/name, in place of what was there."""
    target = folder / name
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
    if content is None:
        target.mkdir()
    else:
        target.write_bytes(content)


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(("where", "what", "probe"), card_cases())
def test_hfpatch_card(capsys, paths, carded, tmp_path, where, what, probe):
    folder, run = tmp_path / "model", tmp_path / "run"
    shutil.copytree(carded / "model", folder)
    shutil.copytree(carded / "run", run)
    given_folder, given_run, names = str(folder), str(run), (str(run), "results.json")
    if where == "folder" and what == "read-only":
        paths.make_read_only(folder)
        names = (str(folder),)
    elif where == "folder":
        given_folder = paths(what)
        names = (given_folder or "''", "folder")
    elif where == "run":
        given_run = paths(what)
        names = (given_run or "''", "--results")
    elif where in ("folder-file", "run-file"):
        _place(folder if where == "folder-file" else run, *what)
        names = (what[0], str(folder if where == "folder-file" else run))
    else:
        data = json.loads((run / "results.json").read_text())
        (run / "results.json").write_text(json.dumps({**data, what[0]: what[1]}))
    before = _snapshot(folder)
    if cli_call(capsys, ["card", given_folder, "--results", given_run], ("hfpatch",), names, probe) != 0:
        assert _snapshot(folder) == before, "the refused card changed the folder"


def test_the_results_fields_fuzzed_are_a_runs(carded):
    assert set(RESULTS_FIELDS) == set(json.loads((carded / "run" / "results.json").read_text())), \
        "fuzz the new field of results.json: add it to RESULTS_FIELDS"


# ------------------------------------------------------------------------------------------- what the fuzz covers


def test_every_declared_option_is_fuzzed():
    """The generators read the declarations, so that a new option is fuzzed without editing this file; this holds
    them to it (and makes a new keyword of patch() or a new evaluation ask for its entry here)."""
    import hfpatch.apply
    from hfpatch import patch_options
    from hfpatch.evaluate import EVALUATIONS
    from hfpatch.search.options import declared

    ids = " ".join(c.id for c in [*patch_cases(), *patch_cli_cases(), *eval_cases(), *eval_cli_cases(),
                                  *search_cases(), *search_cli_cases()])
    assert all(f"patch:{s}.{o}=" in ids for s, rec in SCHEMES.items() for o in rec.options)
    assert all(f"patch:temperature-{k}.{o}=" in ids for k, rec in TEMPERATURES.items() for o in rec.options)
    assert all(f"patch:placement-{k}.{o}=" in ids for k, rec in PLACEMENTS.items() for o in rec.options)
    assert set(inspect.signature(hfpatch.apply.patch).parameters) - {"model", "options"} == set(PATCH_KEYWORDS), \
        "give patch()'s new keyword its bad values in PATCH_KEYWORDS"
    assert all(f"--{name.replace('_', '-')}=" in ids for name in patch_options.offered()["SCHEME_OPTIONS"]
               if name != "layers")  # (--layers takes SCHEME@LAYERS groups: LAYERS_TEXT)
    assert set(EVAL_BASE) == set(EVALUATIONS), "give the new evaluation its quick settings in EVAL_BASE"
    assert all(f"evaluate.run-{name}:{action.dest}=" in ids and f"hfpatch-eval-{name}:{flag_of(action)}=" in ids
               for name in EVALUATIONS for action, _ in eval_settings(name))
    for f in declared():
        d = f.metadata["declared"]
        assert (f"search:{f.name}=" in ids or not d.python) and (f"search:--{f.name.replace('_', '-')}=" in ids
                                                                   or not d.cli), f.name
