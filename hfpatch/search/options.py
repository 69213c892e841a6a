"""What `hfpatch search` takes, declared once: `SearchOptions`, a frozen dataclass whose fields carry their help, their
command-line form and whether they decide the search's numbers. From it come the command line (`build_parser`), the
Python call (`SearchOptions(...)`, or `search(model, tokenizer, target_length, **options)`, checked by the same
dataclass), the results file's identity (`identity`) and the options table of the docs (`options_table`).

Pure Python: `hfpatch search --help` (and a bad flag's error) answers without importing torch or transformers.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..evaluate.parsing import parse_length
from ..utils import command
from ..utils.timing import duration

# The families of the search space (space.FAMILIES holds their records, in this order; a test keeps them equal).
FAMILY_NAMES = ("longrope", "yarn", "self-extend", "dual-chunk")
# The dtypes a command line may load the model in. "fast": bf16 where the device computes in it natively (a GPU
# with bf16, a CPU with AMX or AVX-512 BF16), else fp32.
DTYPES = ("fast", "fp32", "bf16", "fp16", "auto")
_UNITS = {"s": 1, "m": 60, "min": 60, "h": 3600}
MAX_TARGET = 2**31 - 1  # position ids are int32 in some kernels


# ------------------------------------------------------------------------------------------------------- budget

@dataclass(frozen=True)
class Budget:
    """How much the search may spend: candidates scored in all (the results file's, the reference included), the
    wall time of this run, or both (whichever ends first)."""

    evaluations: int | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        if self.evaluations is None and self.seconds is None:
            raise ValueError("the search needs a budget: a number of candidates, a wall time, or both (e.g. --budget "
                             "2h, --budget 200, --budget 30m,200)")
        if self.evaluations is not None and (isinstance(self.evaluations, bool) or not isinstance(self.evaluations, int)
                                             or self.evaluations < 1):
            raise ValueError(f"a budget of candidates must be a positive integer, got {self.evaluations!r}")
        if self.seconds is not None and (isinstance(self.seconds, bool) or not isinstance(self.seconds, (int, float))
                                         or not math.isfinite(self.seconds) or self.seconds <= 0):
            raise ValueError(f"a wall-time budget must be a positive number of seconds, got {self.seconds!r}")

    def __str__(self) -> str:
        parts = [duration(self.seconds)] if self.seconds is not None else []
        return ", ".join(parts + ([f"{self.evaluations} candidates"] if self.evaluations is not None else []))


def parse_budget(text: str) -> Budget:
    """'2h' / '30m' / '90s' (wall time), '200' (candidates), or one of each joined by a comma ('2h,200')."""
    evaluations, seconds = None, None
    for raw in text.split(","):
        part = raw.strip().lower()
        unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if part.endswith(u)), None)
        try:
            value = float(part[: -len(unit)] if unit else part)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value <= 0 or (unit is None and value != int(value)):
            raise ValueError(f"--budget {text!r}: {raw.strip()!r} is neither a wall time (2h, 30m, 90s) nor a number "
                             "of candidates (200); one of each may be given, joined by a comma")
        if (seconds if unit else evaluations) is not None:
            kind = "wall time" if unit else "number of candidates"
            raise ValueError(f"--budget {text!r} gives a {kind} twice; give at most one wall time and one number of "
                             "candidates (e.g. 2h,200)")
        if unit:
            seconds = value * _UNITS[unit]
        else:
            evaluations = int(value)
    return Budget(evaluations, seconds)


def families_offered() -> tuple[str, ...]:
    """The families of the search space: FAMILY_NAMES, then, once the scheme registry is imported, the other schemes
    whose records declare a search space (one registered at run time included), in registry order."""
    registry = sys.modules.get("hfpatch.position.registry")
    if registry is None:
        return FAMILY_NAMES
    return FAMILY_NAMES + tuple(name for name, scheme in registry.SCHEMES.items()
                                if scheme.search is not None and name not in FAMILY_NAMES)


def parse_families(text: str | None) -> list[str]:
    """'longrope,yarn' -> the names, checked against families_offered() (None: all of them)."""
    offered = families_offered()
    if text is None:
        return list(offered)
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in offered]
    if unknown or not names:
        raise ValueError(f"--families: unknown {', '.join(unknown) or '(none given)'}; valid: "
                         f"{', '.join(offered)}")
    return list(dict.fromkeys(names))


# ---------------------------------------------------------------------------------------------------- declaration

@dataclass(frozen=True)
class Declared:
    """How an option appears outside Python."""

    help: str
    parse: Callable[[str], Any] | None = None  # command-line text -> value (None: the text itself)
    identity: bool = True  # decides which candidates are drawn or their scores: part of the results file's identity
    cli: bool = True  # a flag of hfpatch search
    python: bool = True  # a keyword of search()
    metavar: str | None = None
    nargs: str | None = None
    choices: tuple[str, ...] | None = None
    default_text: str | None = None  # what a default of None stands for, in words


def option(default: Any, help: str, **how: Any) -> Any:
    """A field of SearchOptions: its default, what it means, and how it appears (Declared)."""
    meta = {"declared": Declared(help, **how)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


REQUIRED: Any = dataclasses.MISSING


def _count(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _fraction(name: str, value: Any, low: float, high: float, closed: bool = True) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (low <= value <= high if closed else low <= value < high):
        raise ValueError(f"{name} must be a number in [{low:g}, {high:g}{']' if closed else ')'}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """Everything a search is asked to do. Made from keyword arguments (search(), or directly) or from the command
    line (`from_args`); every value is checked when it is made, before any model is read."""

    target_length: int = option(REQUIRED, "the length to extend to, e.g. 32k, 16384", parse=parse_length,
                                metavar="LENGTH")
    budget: Budget | str = option(REQUIRED, "wall time of this run (2h, 30m, 90s), a number of candidates in all "
                                  "(200), or one of each (2h,200)", parse=parse_budget, identity=False)
    out: str = option("runs/search", "folder for results.json, best.json, table.md and the plot; the same command "
                      "resumes it", identity=False)
    text_files: list[str] | None = option(None, "calibration text: files or folders of .txt files", nargs="+",
                                          identity=False, metavar="PATH",
                                          default_text="the standard library's long source files")
    seed: int = option(0, "seed of the calibration samples and of the candidates drawn", parse=int)
    families: list[str] | None = option(None, f"the families searched, comma-separated: {', '.join(FAMILY_NAMES)}",
                                        parse=parse_families, default_text="all that apply to the model")
    population: int = option(8, "candidates per generation", parse=int)
    parents: int = option(4, "the best candidates new ones come from", parse=int)
    samples: int = option(2, "calibration samples of the target length, for the full-length score", parse=int)
    proxy_tokens: int = option(4096, "tokens of a proxy sample: real text whose position ids skip so that it spans "
                               "the target length; candidates are ranked on such samples and the best --finalists "
                               "scored at full length (0: every candidate at full length)", parse=int)
    proxy_segments: int = option(8, "segments of a proxy sample: its start, the passkey line, the span's source, its "
                                 "end, and the others spread evenly between them", parse=int)
    proxy_samples: int = option(2, "proxy samples per candidate", parse=int)
    finalists: int = option(4, "candidates scored at full length after the proxy ranking", parse=int)
    span: int | None = option(None, "tokens of the repeated span", parse=int, default_text="min(32, window / 4)")
    needle_weight: float = option(0.5, "weight of needle NLL in the score, the rest on plain NLL", parse=float)
    guard: float = option(0.01, "largest relative rise of perplexity at the trained window (0.01: 1 %%)",
                          parse=float)
    window: int | None = option(None, "the trained window", parse=int, default_text="the model's config")
    overwrite: bool = option(False, "discard an existing results file instead of resuming", identity=False)
    plot: bool = option(True, "draw OUT/convergence.png", identity=False)
    progress: bool = option(True, "a progress bar on stderr", identity=False)
    memory_check: bool = option(True, "refuse a target whose forward needs more memory than is free",
                                identity=False)
    # loading: the command line's own (search() takes a loaded model)
    model: str = option("smollm2", "hub id, local folder, .gguf file, or smollm2", python=False, identity=False)
    dtype: str = option("fast", "weights dtype: fast (bf16 where the device computes in it natively, else fp32), "
                        "fp32, bf16, fp16, auto (the checkpoint's)", python=False, identity=False, choices=DTYPES)
    device: str | None = option(None, "cpu, cuda, cuda:1, ...", python=False, identity=False,
                                default_text="cuda if available, else cpu")

    def __post_init__(self) -> None:
        self._check_budget()
        self._check_lists()
        _count("target_length", self.target_length, 2)
        if self.target_length > MAX_TARGET:
            raise ValueError(f"target_length must be at most {MAX_TARGET} tokens, got {self.target_length}")
        for name in ("population", "parents", "samples", "proxy_samples", "finalists"):
            _count(name, getattr(self, name), 1)
        _count("proxy_segments", self.proxy_segments, 2)
        _count("seed", self.seed, 0)
        _count("proxy_tokens", self.proxy_tokens, 0)
        for name in ("span", "window"):
            if getattr(self, name) is not None:
                _count(name, getattr(self, name), 1)
        _fraction("needle_weight", self.needle_weight, 0.0, 1.0)
        _fraction("guard", self.guard, 0.0, 10.0, closed=False)
        for name in ("overwrite", "plot", "progress", "memory_check"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name, what in (("out", "a folder path"), ("model", "a hub id, a folder, a .gguf file or smollm2")):
            value = getattr(self, name)
            if not isinstance(value, (str, Path)) or not str(value).strip():
                raise (TypeError if not isinstance(value, (str, Path)) else ValueError)(
                    f"{name} must be {what}, got {value!r}")
        if self.device is not None and (not isinstance(self.device, str) or not self.device.strip()):
            raise ValueError(f"device must be a device such as cpu, cuda or cuda:1, got {self.device!r}")

    def _check_budget(self) -> None:
        if isinstance(self.budget, str):
            object.__setattr__(self, "budget", parse_budget(self.budget))
        if not isinstance(self.budget, Budget):
            raise TypeError(f"budget must be a Budget or a string such as '2h' or '30m,200', got {self.budget!r}")

    def _check_lists(self) -> None:
        """families: a comma-separated string or a list of names; text_files: a path or a non-empty list of them."""
        if isinstance(self.families, str):
            object.__setattr__(self, "families", parse_families(self.families))
        elif self.families is not None:
            if not isinstance(self.families, (list, tuple)) or not all(isinstance(f, str) for f in self.families):
                raise TypeError(f"families must be a comma-separated string or a list of family names "
                                f"({', '.join(FAMILY_NAMES)}), got {self.families!r}")
            object.__setattr__(self, "families", parse_families(",".join(self.families)))
        if isinstance(self.text_files, (str, Path)):
            object.__setattr__(self, "text_files", [str(self.text_files)])
        elif self.text_files is not None:
            if not isinstance(self.text_files, (list, tuple)) or not all(
                    isinstance(t, (str, Path)) for t in self.text_files):
                raise TypeError(f"text_files must be a path or a list of paths (files or folders of .txt files), got "
                                f"{self.text_files!r}")
            if not self.text_files or not all(str(t).strip() for t in self.text_files):
                raise ValueError("text_files is empty: give files or folders of .txt files, or leave text_files out "
                                 "for the default corpus")
            object.__setattr__(self, "text_files", [str(t) for t in self.text_files])

    @property
    def the_budget(self) -> Budget:
        assert isinstance(self.budget, Budget)  # __post_init__ parses a string
        return self.budget

    @property
    def family_names(self) -> list[str]:
        return list(self.families) if self.families is not None else list(families_offered())

    def identity(self) -> dict:
        """The options that decide the numbers, as the results file records them."""
        out = {f.name: getattr(self, f.name) for f in declared() if f.metadata["declared"].identity}
        out["families"] = self.family_names
        return out

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SearchOptions:
        return cls(**{f.name: getattr(args, f.name) for f in declared()})

    @classmethod
    def from_python(cls, **settings: Any) -> SearchOptions:
        """SearchOptions from search()'s keywords: a name that is not an option (or is the command line's own) is a
        TypeError naming the accepted ones."""
        accepted = [f.name for f in declared() if f.metadata["declared"].python]
        unknown = sorted(set(settings) - set(accepted))
        if unknown:
            raise TypeError(f"search() got unknown option(s) {', '.join(unknown)}; accepted: {', '.join(accepted)}")
        return cls(**settings)


def declared() -> Iterator[dataclasses.Field]:
    return iter(dataclasses.fields(SearchOptions))


def flag(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def _cli_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = getattr(parse, "__name__", "value")  # argparse names the type in "invalid int value"
    return convert


def build_parser(prog: str = "hfpatch search") -> command.Parser:
    p = command.Parser(prog=prog, description="find the training-free patch (LongRoPE per-pair RoPE factors, YaRN, "
                       "Self-Extend, Dual Chunk Attention settings) that minimises needle-driven perplexity at a "
                       "target length; writes OUT/best.json for hfpatch patch --spec-file")
    for f in declared():
        d: Declared = f.metadata["declared"]
        if not d.cli:
            continue
        default = None if f.default is dataclasses.MISSING else f.default
        if isinstance(default, bool):
            name = flag(f) if not default else "--no-" + f.name.replace("_", "-")
            p.add_argument(name, dest=f.name, action="store_false" if default else "store_true", help=d.help)
            continue
        shown = (f" (default: {d.default_text})" if d.default_text
                 else "" if default is None else f" (default {default})")
        kwargs: dict[str, Any] = {"dest": f.name, "help": d.help + shown, "required": f.default is dataclasses.MISSING}
        if d.parse is not None:
            kwargs["type"] = _cli_type(d.parse)
        if d.choices is not None:
            kwargs["choices"] = list(d.choices)
        if d.nargs is not None:
            kwargs["nargs"] = d.nargs
        if d.metavar is not None:
            kwargs["metavar"] = d.metavar
        p.add_argument(flag(f), default=default, **kwargs)
    return p


def options_table() -> str:
    """The docs' table of options: flag, Python keyword, default, meaning."""
    rows = ["| flag | Python | default | meaning |", "|---|---|---|---|"]
    for f in declared():
        d: Declared = f.metadata["declared"]
        default = "required" if f.default is dataclasses.MISSING else (
            d.default_text or "—" if f.default is None else f"`{f.default}`")
        cli = f"`{flag(f)}`" if d.cli else "—"
        if isinstance(f.default, bool) and f.default:
            cli = f"`--no-{f.name.replace('_', '-')}` (sets it False)"
        python = f"`{f.name}`" if d.python else "— (a loaded model is given)"
        rows.append(f"| {cli} | {python} | {default} | {d.help.replace('%%', '%')} |")
    return "\n".join(rows)


