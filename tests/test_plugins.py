"""Extensions installed as packages (`hfpatch/plugins.py`): a distribution declaring entry points in the group
`hfpatch.plugins` is loaded by the `hfpatch` command before it reads its arguments. Each test installs a stand-in
distribution (a `.dist-info` folder with its `entry_points.txt`, as pip writes one) on the PYTHONPATH of a fresh
process: tests/outside_schemes.py (a module: two position schemes) and an evaluation registered by a callable
(tests/echo.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import REPO

TESTS = REPO / "tests"
REGISTER_ECHO = textwrap.dedent("""\
    def register():
        from hfpatch.evaluate import evaluations

        evaluations.register("echo", "echo")
""")


def install(site: Path, entry_points: str, modules: dict[str, str] | None = None) -> Path:
    """A distribution `demo-plugins` in `site`, as pip installs one: its metadata, its entry points, its modules."""
    info = site / "demo_plugins-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: demo-plugins\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    for name, code in (modules or {}).items():
        (site / f"{name}.py").write_text(code)
    return site


def python(site: Path, code: str, *argv: str, **env: str) -> subprocess.CompletedProcess:
    """`code` in a fresh Python whose path holds `site` and the tests' extension modules, plugins on."""
    path = os.pathsep.join([str(site), str(TESTS), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": path, "HFPATCH_PLUGINS": "", **env})


def hfpatch_command(site: Path, *argv: str, **env: str) -> subprocess.CompletedProcess:
    """The `hfpatch` command in such a process."""
    return python(site, "import sys; from hfpatch.cli import main; sys.exit(main())", *argv, **env)


ENTRY_POINTS = """\
    [hfpatch.plugins]
    schemes = outside_schemes
    echo = demo_echo:register
"""


def test_an_installed_plugin_puts_its_schemes_and_evaluations_on_the_command_line(tmp_path):
    site = install(tmp_path, ENTRY_POINTS, {"demo_echo": REGISTER_ECHO})
    patch = hfpatch_command(site, "patch", "--help")
    assert patch.returncode == 0, patch.stderr
    assert "geometric" in patch.stdout and "decay" in patch.stdout  # the module's two schemes, offered
    echo = hfpatch_command(site, "eval", "echo", "--help")
    assert echo.returncode == 0, echo.stderr
    assert "--lengths" in echo.stdout  # the callable's evaluation is a command


def test_without_the_plugin_or_with_plugins_off_the_names_are_unknown(tmp_path):
    site = install(tmp_path, ENTRY_POINTS, {"demo_echo": REGISTER_ECHO})
    off = hfpatch_command(site, "patch", "--help", HFPATCH_PLUGINS="off")
    assert off.returncode == 0 and "geometric" not in off.stdout
    echo = hfpatch_command(site, "eval", "echo", "--help", HFPATCH_PLUGINS="off")
    assert echo.returncode == 2 and "echo" in echo.stderr


def test_a_plugin_that_fails_to_load_stops_the_command_in_one_line_naming_it(tmp_path):
    site = install(tmp_path, "[hfpatch.plugins]\nbroken = demo_broken\n",
                   {"demo_broken": "raise RuntimeError('no GPU here')\n"})
    done = hfpatch_command(site, "supported")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "'broken' (demo_broken from demo-plugins) failed to load: RuntimeError: no GPU here" in lines[0]
    assert "HFPATCH_PLUGINS=off" in lines[0]


def test_plugins_are_loaded_once_per_process(tmp_path):
    """hfpatch.cli.main called twice in one process (as from Python) loads a plugin once: a second load would
    register its extensions twice, which the registries refuse."""
    site = install(tmp_path, "[hfpatch.plugins]\necho = demo_echo:register\n", {"demo_echo": REGISTER_ECHO})
    code = textwrap.dedent("""
        from hfpatch.cli import main
        from hfpatch.plugins import load_plugins
        for _ in range(2):
            try:
                main(["eval", "echo", "--help"])
            except SystemExit as e:
                assert e.code == 0, e.code
        print(load_plugins())
    """)
    done = python(site, code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "['echo']"
