"""Every evaluation's own --help (`hfpatch eval NAME --help`) answers without loading torch, transformers or
matplotlib: an evaluation module imports only the light side of the sweep (its command line, its plan types, the
parsing helpers, the tables, the plots' module), and the model operations its units need come from the run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hfpatch.evaluate import EVALUATIONS

HEAVY = ("torch", "transformers", "matplotlib")

# Runs the command as `hfpatch eval NAME --help` runs it, then says which heavy modules it left in sys.modules.
HELP = r"""
import contextlib, io, json, sys
from hfpatch.cli import main
printed = io.StringIO()
try:
    with contextlib.redirect_stdout(printed):
        main(["eval", sys.argv[1], "--help"])
    code = 0
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "usage": "usage:" in printed.getvalue(),
                  "loaded": [m for m in sys.argv[2:] if m in sys.modules]}))
"""


@pytest.mark.parametrize("name", EVALUATIONS)
def test_an_evaluations_help_loads_no_torch_transformers_or_matplotlib(name):
    proc = subprocess.run([sys.executable, "-c", HELP, name, *HEAVY], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["code"] == 0 and seen["usage"], seen
    assert seen["loaded"] == [], f"hfpatch eval {name} --help imported {', '.join(seen['loaded'])}"

