"""eval/ is a package run from the repository root: every script answers `python -m eval.NAME --help`, none edits
sys.path, a benchmark's workers start as `python -m eval.NAME` from the repository root, and the scripts read
lengths as `hfpatch eval` does."""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from eval import bench_alibi, benchutil
from eval.code_metrics import python_files, sys_path_edits

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (REPO / "eval").glob("*.py")
                 if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in ast.parse(p.read_text()).body))

# Runs each module as `python -m` runs it (runpy, as __main__, sys.argv set), all in one process so that torch and
# transformers are imported once: {name: [exit code, what it printed]}.
HELP_ALL = r"""
import contextlib, io, json, runpy, sys
out = {}
for name in sys.argv[1:]:
    sys.argv = [name, "--help"]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_module(f"eval.{name}", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code
    except Exception as e:
        code, printed = repr(e), io.StringIO(repr(e))
    out[name] = [code, printed.getvalue()]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def helps() -> dict:
    proc = subprocess.run([sys.executable, "-c", HELP_ALL, *SCRIPTS], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_scripts_are_found():
    assert {"docs_tables", "bench_alibi", "gpu_check", "soak_eval_kills"} <= set(SCRIPTS)
    assert "benchutil" not in SCRIPTS  # helpers only


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_answers_help_as_a_module(helps, name):
    code, printed = helps[name]
    assert code == 0, printed[-2000:]
    assert printed.startswith("usage:"), printed[-2000:]


def test_the_docs_tables_check_runs_as_a_module():
    proc = subprocess.run([sys.executable, "-m", "eval.docs_tables", "--check"], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "up to date" in proc.stdout


def test_nothing_edits_sys_path():
    trees = {p: ast.parse(p.read_text(), str(p)) for root in ("eval", "hfpatch", "recipes", "tests")
             for p in python_files(REPO / root)}
    edits = [str(p.relative_to(REPO)) for p, tree in trees.items() if sys_path_edits(tree)]
    assert edits == []


def test_a_benchmark_worker_starts_as_a_module_from_the_repository_root(monkeypatch):
    started = []

    def run(cmd, **kwargs):
        started.append((cmd, kwargs.get("cwd")))
        return subprocess.CompletedProcess(cmd, 0, stdout='{"seconds": [1.0]}\n', stderr="")

    monkeypatch.setattr(benchutil.subprocess, "run", run)
    got = benchutil.worker_grid(bench_alibi.MODULE, [2048], lambda L: ["alibi"], ["--layers", "1"])
    assert got == {("alibi", 2048): {"seconds": [1.0]}}
    assert started == [([sys.executable, "-m", "eval.bench_alibi", "--worker", "alibi", "--length", "2048",
                         "--layers", "1"], REPO)]


def test_the_scripts_read_lengths_as_hfpatch_eval_does():
    assert benchutil.length_list("8k,2048") == [2048, 8192]
    with pytest.raises(argparse.ArgumentTypeError, match="repeats a length"):
        benchutil.length_list("2k,2048")


def test_a_bad_length_is_one_usage_line(capsys):
    with pytest.raises(SystemExit) as stop:
        bench_alibi.main(["--lengths", "2k,lots"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert re.search(r"--lengths: length 'lots' is not a number of tokens", err), err


def test_docs_name_the_scripts_as_modules():
    changelog = (REPO / "CHANGELOG.md").read_text()
    unreleased = changelog.split("\n## ")[1]  # the top section
    texts = {"CHANGELOG.md (unreleased)": unreleased}
    for path in [REPO / "README.md", REPO / ".ci" / "run", *(REPO / "docs").rglob("*.md"),
                 *(REPO / "eval").rglob("*.md"), *(REPO / "eval").glob("*.sh"), *(REPO / "eval").glob("*.py")]:
        texts[str(path.relative_to(REPO))] = path.read_text()
    as_files = {name: re.findall(r"(?:python3?|\$PY) eval/\w+\.py", text) for name, text in texts.items()}
    assert {name: found for name, found in as_files.items() if found} == {}
