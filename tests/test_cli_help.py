"""Every `--help` of the `hfpatch` command answers without loading torch, transformers or matplotlib: the command
itself, each of its subcommands (read off its parser, so that a new one is covered too) and every evaluation's own
(`hfpatch eval NAME --help`). An evaluation module imports only the light side of the sweep (its command line, its
plan types, the parsing helpers, the tables, the plots' module), and the model operations its units need come from
the run; `hfpatch patch` builds its flags from hfpatch.patch_options, the registries' declaration, which a test here
holds equal to the registries themselves."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from hfpatch import patch_options
from hfpatch.cli import build_parser
from hfpatch.evaluate import EVALUATIONS

HEAVY = ("torch", "transformers", "matplotlib")

# Runs `hfpatch ARGS... --help` as the command runs it (after importing the modules named in "first"), then says
# what it printed and which heavy modules it left in sys.modules.
HELP = r"""
import contextlib, importlib, io, json, sys
asked = json.loads(sys.argv[1])
for module in asked["first"]:
    importlib.import_module(module)
from hfpatch.cli import main
printed, errors = io.StringIO(), io.StringIO()
try:
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        code = main([*asked["args"], "--help"])
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "printed": printed.getvalue(), "stderr": errors.getvalue(),
                  "loaded": [m for m in asked["heavy"] if m in sys.modules]}))
"""


def help_of(args: list[str], first: tuple[str, ...] = ()) -> dict:
    """What `hfpatch ARGS... --help` did in a fresh process (that imported `first` before): its exit code, what it
    printed on stdout and stderr, and the heavy modules it imported."""
    asked = json.dumps({"args": args, "first": list(first), "heavy": HEAVY})
    proc = subprocess.run([sys.executable, "-c", HELP, asked], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "120"})
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    seen["usage"] = "usage:" in seen["printed"]
    return seen


def subcommands() -> list[str]:
    """The subcommands the `hfpatch` parser has, read off the parser itself."""
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return list(sub.choices)


@pytest.mark.parametrize("command", ["", *subcommands()])
def test_every_subcommands_help_loads_no_torch_transformers_or_matplotlib(command):
    seen = help_of([command] if command else [])
    if command == "lm-eval" and importlib.util.find_spec("lm_eval") is None:  # the optional extra: how to get it
        assert seen["code"] == 2 and "pip install 'hfpatch[lm-eval]'" in seen["stderr"], seen
    else:
        assert seen["code"] == 0 and seen["usage"], seen
    assert seen["loaded"] == [], f"hfpatch {command} --help imported {', '.join(seen['loaded'])}"


def test_the_subcommands_include_the_ones_this_file_was_written_for():
    """The enumeration above reads the parser: it finds every subcommand (a guard against reading nothing)."""
    assert {"describe", "patch", "supported", "eval", "card", "search", "lm-eval"} <= set(subcommands())


@pytest.mark.parametrize("name", EVALUATIONS)
def test_an_evaluations_help_loads_no_torch_transformers_or_matplotlib(name):
    seen = help_of(["eval", name])
    assert seen["code"] == 0 and seen["usage"], seen
    assert seen["loaded"] == [], f"hfpatch eval {name} --help imported {', '.join(seen['loaded'])}"


def test_the_patch_flags_declaration_is_the_registries_own():
    """hfpatch.patch_options.DECLARED (what `hfpatch patch` builds its flags and help from) equals what the
    registries hold: scheme names and their factor, every option's form, help and schemes, norm kinds, placements
    and their options, attention temperatures. On failure, `python -m hfpatch.patch_options` prints the declaration
    to paste."""
    assert patch_options.from_registries() == patch_options.DECLARED


def test_patch_help_without_torch_is_the_help_the_registries_give():
    """`hfpatch patch --help` from the declaration (a fresh process: no torch) prints, word for word, what it prints
    built from the registries themselves (a process that imported them first)."""
    light, heavy = help_of(["patch"]), help_of(["patch"], first=("hfpatch.position.registry",))
    assert light["loaded"] == [] and "torch" in heavy["loaded"]
    assert light["code"] == heavy["code"] == 0 and "--attention-factor" in light["printed"]
    assert light["printed"] == heavy["printed"]
