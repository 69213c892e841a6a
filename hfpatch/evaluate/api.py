"""The evaluations from Python: the same runs as `hfpatch eval NAME`, on a model given by name or already loaded, with
the command's settings as keyword arguments, returning what results.json holds.

    import hfpatch.evaluate as ev
    data = ev.perplexity(model, tok, lengths=[2048, 8192], patches="none,yarn:2", text_files=["book.txt"])
    data["cells"]          # one per (patch, length): ppl, bits per byte, the documents' records
    print(data["report"])  # the Markdown tables the command prints

A setting is the command's option with `_` for `-` (`lengths`, `patches`, `text_files`, `max_docs`, ...): a list
is taken where the command takes a comma-separated or repeated value, and everything is validated by the
command's own checks, so a bad setting is the same one-line error. With `out=`, the results file there is resumed
exactly as the command resumes it; without it, the run writes into a temporary folder that is removed afterwards.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

from .definition import Evaluation, build_parser, refuse_empty
from .evaluations import evaluation
from .sweep import Given, execute


def run(name: str, model: Any, tokenizer: Any = None, *, out: str | None = None, **settings: Any) -> dict:
    """Run evaluation `name` ("ppl", "passkey", "ruler", "niah") on `model`.

    Args:
        name: the evaluation, as `hfpatch eval NAME` names it.
        model: a model name as the command takes it (a folder, a .gguf file, a hub id, "smollm2"), or a loaded
            transformers causal LM (patched or not; evaluated as it is, in the transformers engine, in eval mode:
            each of its modules gets its own mode back afterwards).
        tokenizer: the loaded model's tokenizer (required with a loaded model; a name loads its own).
        out: the folder for results.json, table.md and the plot; a run there resumes as the command does.
            None: a temporary folder, removed after the run.
        **settings: the command's options, `_` for `-`: e.g. `patches="none,yarn:2"`, `lengths=[2048, 8192]`.
            With a loaded model, `dtype`, `device` and `device_map` (how a model given by name is loaded) are
            refused where they differ from the model, which runs as it is; results.json records its dtype. A
            setting given as None takes the command's default, as if left out; one given empty ("", []) is
            refused; `patches` is a comma-separated string of spec strings or a list of them. A setting takes the
            type its option reads: an integer for an integer option (`trials=2`), text, a number or a path for
            the others, a string or a list of strings for one that takes several (`text_files`).

    Returns:
        The results file's content (settings, model, cells with their records and numbers) and, under "report",
        the Markdown tables the command prints.

    Raises:
        ValueError: an unknown evaluation or setting, a bad value, or what the command refuses (the same message);
            a text file that is not there is a NoSuchPath, a FileNotFoundError that is a ValueError too.
        TypeError: a setting of another type than its option takes (`patches` of another type than a string or a
            list of strings, `trials=2.5`), or a tokenizer that is not one.
    """
    ev = evaluation(name)
    given = None if isinstance(model, str) else _given(model, tokenizer)
    if out is None:
        with tempfile.TemporaryDirectory(prefix=f"hfpatch-{ev.name}-") as tmp:
            return _execute(ev, model, given, {"no_plot": True, **settings, "out": tmp})
    return _execute(ev, model, given, {**settings, "out": out})


def _given(model: Any, tokenizer: Any) -> Given:
    if tokenizer is None:
        raise ValueError("a loaded model needs its tokenizer: run(name, model, tokenizer, ...) (or give the model's "
                         "name, which loads both)")
    if not all(callable(getattr(tokenizer, m, None)) for m in ("encode", "decode", "get_vocab")):
        raise TypeError(f"tokenizer must be the loaded model's tokenizer (a transformers tokenizer: encode, decode, "
                        f"get_vocab), got {_kind(tokenizer)}")
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    return Given(model, tokenizer, str(name))


def _execute(ev: Evaluation, model: Any, given: Given | None, settings: dict) -> dict:
    args = settings_namespace(ev, model if given is None else given.name, settings)
    data = execute(ev, args, given=given)
    if data is None:  # dry_run=True
        return {"dry_run": True}
    return data


def settings_namespace(ev: Evaluation, model_name: str, settings: dict) -> argparse.Namespace:
    """The parsed arguments the command would have for these settings: its defaults, then each setting (but those
    given as None, which keep the default) through the option's own type and choices."""
    parser = build_parser(ev)
    args = parser.parse_args(["--model", model_name])
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "model")}
    for key, value in settings.items():
        action = actions.get(key)
        if action is None:
            raise ValueError(f"{ev.name}: unknown setting {key!r}; it takes: {', '.join(sorted(actions))}")
        if value is None:  # the command's default, as if the setting were left out
            continue
        if key == "patches":
            value = patch_specs(value)
        setattr(args, key, _value(action, key, value))
    refuse_empty(args)
    return args


def patch_specs(value: Any) -> str:
    """The `patches` setting as the command takes it (one comma-separated string), from a string or a list or tuple
    of spec strings; TypeError for anything else."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    wrong = [v for v in items if not isinstance(v, str)]
    if not wrong:
        return ",".join(items)
    what = _kind(wrong[0]) if value is wrong[0] else f"a {type(value).__name__} holding {_kind(wrong[0])}"
    raise TypeError("patches takes patch spec strings, as `hfpatch eval --patches` does: one comma-separated string "
                    f"('none,yarn:2') or a list of spec strings (['none', 'yarn:4:beta_fast=16']); got {what}")


def _kind(value: Any) -> str:
    return "None" if value is None else f"{value!r} ({type(value).__name__})"


def _value(action: argparse.Action, key: str, value: Any) -> Any:
    if action.nargs == 0:  # a flag (store_true)
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be True or False, got {value!r}")
        return value
    if action.nargs in ("+", "*"):
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        wrong = [v for v in items if not isinstance(v, (str, os.PathLike))]
        if wrong:
            raise TypeError(f"{key} takes a string or a list of strings, as --{key.replace('_', '-')} does; got "
                            f"{_kind(wrong[0])}")
        return [_one(action, key, os.fspath(v)) for v in items]
    if isinstance(value, (list, tuple)):  # the command takes these comma-separated
        value = ",".join(str(v) for v in value)
    return _one(action, key, value)


def _one(action: argparse.Action, key: str, value: Any) -> Any:
    if action.type is int and not isinstance(value, str):  # an integer as it is (a bool, a float is refused)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{key} must be an integer, as --{key.replace('_', '-')} takes; got {_kind(value)}")
    elif action.type is not None and not isinstance(value, str):
        value = str(value)  # the option's own parsing judges it, as the command's would
    if action.type is None and value is not None and not isinstance(value, str):
        if isinstance(value, bool) or not isinstance(value, (int, float, os.PathLike)):
            raise TypeError(f"{key} takes text (or a number, or a path), as --{key.replace('_', '-')} does; got "
                            f"{_kind(value)}")
        value = str(value)  # the command reads this option as text (e.g. "all" or a number), and so do we
    if action.type is not None and isinstance(value, str):
        try:
            value = action.type(value)  # type: ignore[operator]
        except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
            raise ValueError(f"{key}: {e}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{key} must be one of {', '.join(map(str, action.choices))}; got {value!r}")
    return value


def perplexity(model: Any, tokenizer: Any = None, *, out: str | None = None, **settings: Any) -> dict:
    """`hfpatch eval ppl` from Python: perplexity at each length, per patch spec (see `run`)."""
    return run("ppl", model, tokenizer, out=out, **settings)


def passkey(model: Any, tokenizer: Any = None, *, out: str | None = None, **settings: Any) -> dict:
    """`hfpatch eval passkey` from Python: passkey retrieval by length and depth, per patch spec (see `run`)."""
    return run("passkey", model, tokenizer, out=out, **settings)


def ruler(model: Any, tokenizer: Any = None, *, out: str | None = None, **settings: Any) -> dict:
    """`hfpatch eval ruler` from Python: the synthetic RULER tasks by length, per patch spec (see `run`)."""
    return run("ruler", model, tokenizer, out=out, **settings)


def niah(model: Any, tokenizer: Any = None, *, out: str | None = None, **settings: Any) -> dict:
    """`hfpatch eval niah` from Python: needle in a haystack by depth and length, per patch spec (see `run`)."""
    return run("niah", model, tokenizer, out=out, **settings)
