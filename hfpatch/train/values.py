"""A recipe config's values: YAML read safely (plain data only, boolean words kept as written, a key given twice
refused, aliases bounded), `key=value` overrides on top, and a config dataclass built from the plain values key by key
(`build`), with the list of its keys the docs' reference is made from (`keys`). hfpatch.train.config defines the
dataclasses and re-exports these."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import types
import typing
from collections.abc import Hashable
from pathlib import Path
from typing import Any, TypeVar

import yaml


class ConfigError(ValueError):
    pass


# ---------------------------------------------------------------------------------------------------- building one

C = TypeVar("C")


def build(cls: type[C], values: dict, where: str = "") -> C:
    """The config dataclass `cls` made from plain values (YAML's), every key checked against its fields in field
    order: a section key by key over its defaults, any other key as a whole, converted where YAML reads a value
    otherwise than meant (an int for a float, 3e-4 read as a string, a boolean word for a string); then the keys
    that are none of its fields. Its own checks then run as it is made."""
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in fields:
        name = f"{where}{f.name}"
        if f.name not in values:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{name} is required")
            continue
        value, hint = values[f.name], hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(f"{name} must be a section (key: value pairs), got {value!r}")
            kwargs[f.name] = build(hint, value, f"{name}.")
        else:
            kwargs[f.name] = _typed(name, value, hint, f.metadata.get("path", False))
    unknown = [key for key in values if key not in kwargs and key not in {f.name for f in fields}]
    if unknown:
        name = f"{where}{unknown[0]}"
        raise ConfigError(f"unknown config key {name!r}; valid keys here: "
                          f"{', '.join(sorted(f.name for f in fields))}")
    return cls(**kwargs)


def keys(cls: type, where: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted key, type as annotated, default, what it means) of every key of the config dataclass `cls`, a section's
    keys after its name (the config reference of the docs is made from these); the default of a key that must be
    given is REQUIRED."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = f"{where}{f.name}"
        if isinstance(hints[f.name], type) and dataclasses.is_dataclass(hints[f.name]):
            out += keys(hints[f.name], f"{name}.")
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = REQUIRED
        if default is None and "None" not in str(f.type):  # "not given", refused when made (pretrain's tokenizer)
            default = REQUIRED
        out.append((name, str(f.type), default, f.metadata.get("help", "")))
    return out


REQUIRED = "required"  # keys(): the default of a key that must be given


def _accepted(hint: Any) -> tuple[tuple[type, ...], type]:
    """The types a field's annotation accepts (list[str] | None -> (list, NoneType)) and the type of a list's
    items (str unless named)."""
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    options = typing.get_args(hint) if union else (hint,)
    kinds = tuple(typing.get_origin(o) or o for o in options)
    items = next((typing.get_args(o)[0] for o in options if typing.get_origin(o) is list and typing.get_args(o)),
                 str)
    return kinds, items


def _typed(name: str, value: Any, hint: Any, path: bool) -> Any:
    """`value` as the field `name` of type `hint` takes it, or ConfigError saying what it accepts."""
    kinds, items = _accepted(hint)
    value = str(value) if isinstance(value, Word) and str in kinds and bool not in kinds else _plain(value)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if float in kinds and isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
        with contextlib.suppress(ValueError):
            value = float(value)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join("null" if t is type(None) else t.__name__ for t in kinds)
        raise ConfigError(f"{name} must be {names}, got {value!r} ({type(value).__name__})")
    if isinstance(value, list) and not all(isinstance(v, items) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"{name} must be a list of {'strings' if items is str else items.__name__ + 's'}, "
                          f"got {value!r}")
    return _home(value) if path else value


def _home(value: Any) -> Any:
    """~ at the start of a path means the home folder, as in a shell (YAML leaves it as it is)."""
    if isinstance(value, str):
        return os.path.expanduser(value)
    if isinstance(value, list):
        return [os.path.expanduser(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------------- reading YAML

def _set(tree: dict, dotted: str, value) -> None:
    *path, last = dotted.split(".")
    for part in path:
        tree = tree.setdefault(part, {})
        if not isinstance(tree, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
    tree[last] = value


class Word(str):
    """A YAML 1.1 boolean word other than true/false (yes, no, on, off, y, n) as written: a field of type str keeps
    the word (`precision: no` is the string "no", which YAML 1.1 reads as false), any other value reads it as the
    boolean it means (`lora.enabled: yes`, `patch: {exact: no}`)."""

    @property
    def meaning(self) -> bool:
        return self.lower() in ("yes", "y", "on")


class DuplicateKey(Exception):
    pass


class _Loader(yaml.SafeLoader):
    """yaml.SafeLoader that keeps the boolean words (Word) and refuses a key given twice in one mapping (YAML's
    own loader keeps the last value without a word)."""

    def construct_yaml_bool(self, node) -> Any:
        if node.value.lower() in ("true", "false"):
            return super().construct_yaml_bool(node)
        return Word(node.value)

    def construct_mapping(self, node, deep=False) -> dict:
        if isinstance(node, yaml.MappingNode):
            lines: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # << merges keys meant to be overridden
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if isinstance(key, Hashable) and key in lines:
                    raise DuplicateKey(f"key {key!r} is given twice (lines {lines[key]} and {line}); keep one")
                if isinstance(key, Hashable):
                    lines[key] = line
        return super().construct_mapping(node, deep=deep)


_Loader.add_constructor("tag:yaml.org,2002:bool", _Loader.construct_yaml_bool)


def _plain(value) -> Any:
    """`value` with every Word read as the boolean it means (values no schema types: patch, model_config, lists)."""
    if isinstance(value, Word):
        return value.meaning
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _yaml(text: str, where: str) -> Any:
    """The plain data of a YAML text (a tag such as !!python/object is refused, never imported or called; boolean
    words stay Words, a key given twice is refused), its errors as one ConfigError line."""
    try:
        return yaml.load(text, Loader=_Loader)  # _Loader is a yaml.SafeLoader: plain data only
    except DuplicateKey as e:
        raise ConfigError(f"{where}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        what = " ".join(str(getattr(e, "problem", None) or e).split())
        if "constructor" in what and "python/" in what:
            what += "; configs are plain YAML (numbers, strings, lists, key: value), !!python/ tags are not accepted"
        raise ConfigError(f"{where}: not valid YAML: {what}{at}") from None


MAX_VALUES = 100_000  # a recipe config holds a few hundred; more is an expansion (YAML aliases), not a config


def _check_size(values, limit: int = MAX_VALUES) -> None:
    """Count the values of the config as copies (an alias read twice counts twice), stopping past `limit`: YAML
    aliases let a few kB expand to billions of values, which safe_load builds as shared references in no time, but
    which anything that copies or writes the config (config.json at the final save) expands."""
    count, stack = 0, [values]
    while stack:
        item = stack.pop()
        count += 1
        if count > limit:
            raise ConfigError(f"the config holds more than {limit} values (YAML anchors and aliases expand to "
                              "copies); a recipe config needs a few hundred")
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def read(path: str | None, overrides: list[str]) -> dict:
    """The values of a YAML file (none: {}) with `key=value` overrides (dotted keys reach into sections, values are
    YAML), not yet checked."""
    values: dict = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {path}")
        values = _yaml(p.read_text(), str(path)) or {}
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: expected key: value pairs at the top level")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key=value")
        _set(values, key.strip(), _yaml(raw, f"override {item!r}") if raw.strip() else None)
    _check_size(values)
    return values
