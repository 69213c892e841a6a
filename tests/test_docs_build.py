"""The documentation site builds strictly: `mkdocs build --strict` with no warning at all (griffe's about the API
reference's annotations included), and CI's build is one that a warning can fail."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def warnings_of(log: str) -> list[str]:
    """The lines of a mkdocs log at level WARNING or above ("WARNING -  ...", "ERROR   -  ...")."""
    lines = (ANSI.sub("", line).strip() for line in log.splitlines())
    return [line for line in lines if re.match(r"(WARNING|ERROR)\s+-", line)]


def test_the_docs_build_strictly_with_no_warning(tmp_path):
    pytest.importorskip("mkdocstrings", reason="the docs extra (pip install -e '.[docs]') builds the site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2.0, not a build warning
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert warnings_of(log) == [], log[-4000:]
    assert proc.returncode == 0, log[-4000:]
    assert (tmp_path / "site" / "reference" / "api" / "index.html").is_file()


def test_ci_builds_the_docs_without_quiet():
    """`--quiet` drops everything below ERROR, warnings included, so strict mode would never see one."""
    builds = [shlex.split(line) for line in (ROOT / ".ci" / "run").read_text().splitlines()
              if line.strip().startswith("mkdocs build")]
    assert builds, ".ci/run builds no docs"
    for argv in builds:
        assert "--strict" in argv and not {"-q", "--quiet"} & set(argv), argv


def test_warnings_of_reads_mkdocs_log_levels():
    log = ("INFO    -  Building documentation\n"
           "\x1b[33mWARNING \x1b[0m-  griffe: hfpatch/apply.py:171: No type or annotation for parameter 'model'\n"
           "ERROR   -  Error reading page 'x.md'\n"
           "INFO    -  a page that says WARNING - in its text\n")
    assert warnings_of(log) == ["WARNING -  griffe: hfpatch/apply.py:171: No type or annotation for parameter 'model'",
                                "ERROR   -  Error reading page 'x.md'"]


def test_the_readme_links_every_section_of_the_site():
    """Each top-level entry of the site's navigation (a page, or a section by one of its pages) is linked from
    README.md."""
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    readme = (ROOT / "README.md").read_text()
    linked = {path.removeprefix("docs/") for path in re.findall(r"\]\(([^)#]+)", readme)}
    linked |= {"changelog.md"} if "CHANGELOG.md" in linked else set()  # the site's changelog page includes it
    missing = []
    for entry in nav:
        (title, target), = entry.items()
        pages = [target] if isinstance(target, str) else [p for item in target for p in item.values()]
        if not linked & set(pages):
            missing.append(title)
    assert missing == []
