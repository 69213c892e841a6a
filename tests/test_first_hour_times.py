"""eval/first_hour.py: the test suite's counts read off pytest's own junit report, each time given as the range over
its records with their conditions, and records appended to the results file the README's numbers come from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from eval import first_hour

TESTS = textwrap.dedent("""
    import pytest

    pytestmark = []

    def test_one():
        pass

    def test_two():
        pass

    def test_fails():
        assert False

    @pytest.mark.skip(reason="no books here")
    def test_book():
        pass

    @pytest.mark.parametrize("case", ["a", "b"])
    def test_phi3(case):
        pytest.skip("Phi3Config accepts only default/longrope")
""")
SKIPPED_MODULE = 'import pytest\n\npytest.importorskip("no_such_package_here", reason="the extra is not installed")\n'
# a reason holding a single quote: pytest's report quotes it with double quotes
QUOTED_SKIP = 'import pytest\n\npytest.importorskip("no_such_package_here", reason="pip install \'x[extra]\'")\n'


@pytest.fixture
def junit(tmp_path):
    """A junit report written by pytest itself: 2 passed, 1 failed, 3 skipped in one file, two modules skipped
    whole."""
    (tmp_path / "test_sample.py").write_text(TESTS)
    (tmp_path / "test_extra.py").write_text(SKIPPED_MODULE)
    (tmp_path / "test_quoted.py").write_text(QUOTED_SKIP)
    report = tmp_path / "junit.xml"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--rootdir",
                    str(tmp_path), "-c", os.devnull, f"--junitxml={report}", str(tmp_path)], cwd=tmp_path, env=env,
                   capture_output=True, timeout=300)
    return report


def test_junit_summary_counts_as_pytest_does(junit):
    summary = first_hour.junit_summary(junit)
    assert summary["counts"] == {"passed": 2, "skipped": 5, "failed": 1, "errors": 0}
    assert {s["reason"]: s["tests"] for s in summary["skips"]} == {
        "Phi3Config accepts only default/longrope": 2, "no books here": 1, "the extra is not installed": 1,
        "pip install 'x[extra]'": 1}
    assert summary["files"]["test_sample.py"]["tests"] == 6


def run(wall, idle=None, load=None, kind="tests", **more):
    return {"kind": kind, "wall_s": wall, "idle": idle, "load": load, "machine": "2-core x86-64", **more}


def test_clock_reads_as_the_docs_write_times():
    assert [first_hour.clock(s) for s in (69, 119.6, 355, 1231, 3720)] == [
        "69 s", "2 min", "5 min 55 s", "20 min 31 s", "1 h 2 min"]


def test_a_time_is_the_range_over_its_runs_with_each_condition():
    runs = [run(355, idle=True), run(395, idle=True), run(1231, idle=False, load="3.5-5"), run(384)]
    assert first_hour.took(runs) == (
        "5 min 55 s to 20 min 31 s (otherwise idle: 5 min 55 s to 6 min 35 s, 2 runs; beside other work, load "
        "3.5-5: 20 min 31 s, one run; load not written down: 6 min 24 s, one run)")
    assert first_hour.load_words(runs) == (
        ", depending on what else the machine ran (otherwise idle: 5 min 55 s to 6 min 35 s)")


def test_one_condition_is_said_once_and_a_written_down_range_counts_as_several_runs():
    assert first_hour.took([run(65, idle=True), run(90, idle=True)]) == "65 s to 90 s (otherwise idle, 2 runs)"
    assert first_hour.took([run([420, 1500], load="varied")]) == \
        "7 min to 25 min (under a load that varied, several runs)"


def test_the_newest_counted_run_gives_the_counts():
    runs = [run(355, counts={"passed": 2324, "skipped": 16}), run(504, kind=".ci/run",
                                                                   counts={"passed": 2334, "skipped": 16}),
            run(155, kind="fast tier", counts={"passed": 1700, "skipped": 3})]
    assert first_hour.counts_text(first_hour.newest_counted(runs)) == "2,334 passed, 16 skipped"


@pytest.fixture
def results(tmp_path, monkeypatch):
    path = tmp_path / "first_hour.json"
    path.write_text(json.dumps({"runs": []}))
    monkeypatch.setattr(first_hour, "RESULTS", path)
    return path


def test_a_run_made_elsewhere_is_appended_with_its_counts(results, junit):
    assert first_hour.main(["--junit", str(junit), "--wall-s", "355", "--commit", "abc1234",
                            "--where", "fresh clone (no ../shared)", "--idle", "yes"]) == 0
    assert first_hour.main(["--record", "installs (tests)", "--wall-s", "69", "--where", "fresh clone"]) == 0
    tests, installs = json.loads(results.read_text())["runs"]
    assert (tests["kind"], tests["wall_s"], tests["commit"], tests["idle"], tests["counts"]["passed"]) == \
        ("tests", 355, "abc1234", True, 2)
    assert (installs["kind"], installs["wall_s"], installs["idle"]) == ("installs (tests)", 69, None)
    assert installs["command"] == first_hour.KINDS["installs (tests)"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--record", "coffee", "--wall-s", "5"], "--record must be one of"),
    (["--record", "main job"], "--wall-s (the run's wall clock in seconds, > 0) is needed"),
    (["--record", "main job", "--wall-s", "-3"], "--wall-s (the run's wall clock in seconds, > 0) is needed"),
    (["--junit", "missing.xml", "--wall-s", "5"], "--junit missing.xml: no such file"),
])
def test_bad_input_is_one_usage_line_and_nothing_recorded(results, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        first_hour.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert json.loads(results.read_text())["runs"] == []


def test_the_suite_run_here_is_timed_counted_and_recorded(results, tmp_path, monkeypatch):
    (tmp_path / "test_sample.py").write_text(TESTS)
    monkeypatch.setitem(first_hour.KINDS, "tests", f"python -m pytest -q -p no:cacheprovider -p no:xdist -c "
                                                   f"{os.devnull} --rootdir {tmp_path} {tmp_path}")
    assert first_hour.main(["--where", "a test"]) == 1  # pytest's own exit status: one test failed
    (entry,) = json.loads(results.read_text())["runs"]
    assert entry["counts"] == {"passed": 2, "skipped": 3, "failed": 1, "errors": 0} and entry["wall_s"] > 0
    assert entry["where"] == "a test" and " at the start, " in entry["load"] and isinstance(entry["idle"], bool)
