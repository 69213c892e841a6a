"""Kill `hfpatch eval ppl` and `hfpatch eval passkey` with SIGKILL at random moments, resume them, and check that
the final results equal an uninterrupted run's.

    python -m eval.soak_eval_kills --kills 25          # per evaluation; a tiny random model, a few seconds a kill

Where a run dies (each kill picks one, at a random save of the results file or a random time):
  half     halfway through writing the temporary results file (half the JSON on disk), before the rename
  before   the temporary file written in full, not yet renamed over results.json
  after    right after the rename
  random   the parent sends SIGKILL at a random time once the work has started
  full     the disk fills halfway through writing the temporary results file (the write raises ENOSPC): the run
           must end with one line naming the file and exit code 2, its temporary file removed
After every kill, results.json (if any) must be valid JSON; the next run resumes from it. The last run is not
killed; its results must equal the uninterrupted run's, timings and the list of runs aside.

    python -m eval.soak_eval_kills --kills 25 --seed 0 --json eval/results/reliability/eval_kills.json

tests/test_eval_faults.py runs a few kills of each kind through the same functions.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hfpatch.evaluate.results import comparable
from hfpatch.tiny import char_text, save_sized

REPO = Path(__file__).resolve().parents[1]

# The child: the hfpatch command, with the results file's writes instrumented to SIGKILL the process itself at
# the N-th save (FAULT=mode:N). Only results.json's temporary files count ("results.json.<pid>.tmp"): other files
# written through a temporary one (the file-hash cache's entries) are not saves of the results.
CHILD = r"""
import errno, os, pathlib, signal, sys
mode, n = os.environ.get("FAULT", "none:0").split(":")
n, count = int(n), [0]
write_text, replace = pathlib.Path.write_text, os.replace

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def faulty_write(self, data, *a, **k):
    if self.name.startswith("results.json.") and self.name.endswith(".tmp"):
        count[0] += 1
        if count[0] == n and mode in ("half", "full"):
            write_text(self, data[: len(data) // 2], *a, **k)
            if mode == "full":  # what a full disk does to a write: part of the data on disk, then ENOSPC
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
            die()
    return write_text(self, data, *a, **k)

def faulty_replace(src, dst, *a, **k):
    name = pathlib.Path(src).name
    if name.startswith("results.json.") and name.endswith(".tmp") and count[0] == n and mode in ("before", "after"):
        if mode == "before":
            die()
        replace(src, dst, *a, **k)
        die()
    return replace(src, dst, *a, **k)

pathlib.Path.write_text = faulty_write
os.replace = faulty_replace
from hfpatch.cli import main
sys.exit(main(sys.argv[1:]))
"""

MODES = ("half", "before", "after", "random", "full")
DISK_FULL = 2  # the exit code of a run that stopped on a full disk


def child(argv: list[str], fault: str, env: dict, kill_after: float | None = None,
          results: Path | None = None) -> tuple[int, str]:
    """Run the instrumented command; with kill_after, SIGKILL it that many seconds after results.json first
    changes (the work has started). Returns the exit code (-9 when killed) and what it printed on stderr."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, *argv], env={**env, "FAULT": fault},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if kill_after is not None:
        before = results.stat().st_mtime_ns if results.exists() else None
        while proc.poll() is None:
            now = results.stat().st_mtime_ns if results.exists() else None
            if now is not None and now != before:
                time.sleep(kill_after)
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.005)
    _, err = proc.communicate(timeout=600)
    if proc.returncode not in (0, -signal.SIGKILL, DISK_FULL):
        raise RuntimeError(f"the run failed with exit code {proc.returncode}:\n{err[-2000:]}")
    return proc.returncode, err


def one_line_disk_full(err: str) -> bool:
    """The run stopped on a full disk as a command should: no traceback, and its last line (after the progress
    output) is the one error line, naming results.json and the full disk."""
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if "no space left" in line]
    return ("Traceback" not in err and len(errors) == 1 and lines[-1] == errors[0]
            and "results.json" in errors[0])


def saves_of(data: dict) -> int:
    """How many times a run that produced these results saved its file: once before the work, once per record,
    once per finished cell."""
    return 1 + sum(len(_records(c)) + 1 for c in data["cells"])


def _records(cell: dict) -> list:
    return cell.get("documents") or cell.get("trials") or cell.get("samples") or []


def kill_and_resume(argv: list[str], out: Path, faults: list[tuple[str, float]], env: dict, saves: int) -> dict:
    """Run argv (an hfpatch command writing OUT/results.json; an uninterrupted run saves it `saves` times) once
    per fault, each ended as the fault says (at a save chosen by the fault's fraction of the saves left), each run
    resuming the one before. A run that finishes before its fault comes completes a round: its results are kept and
    the next fault starts a new round from an empty OUT, so that every fault meets work to end. The last round is
    run to the end without a fault. Returns what happened."""
    results = out / "results.json"
    log, rounds = [], []
    for mode, where in faults:
        if mode == "random":
            code, err = child(argv, "none:0", env, kill_after=where, results=results)
        else:
            done = saves_of(json.loads(results.read_text())) - 1 if results.exists() else 0
            code, err = child(argv, f"{mode}:{1 + int(where * max(saves - done, 1))}", env)
        if results.exists():
            json.loads(results.read_text())  # never a half-written results file
        full = code == DISK_FULL
        log.append({"mode": mode, "killed": code == -signal.SIGKILL or full,
                    "one_line": one_line_disk_full(err) if full else None,
                    "tmp_left": sorted(p.name for p in out.glob("results.json.*.tmp")) if full else []})
        if code == 0:  # finished before its fault came
            rounds.append(finished_round(out))
    assert child(argv, "none:0", env)[0] == 0
    rounds.append(finished_round(out))
    return {"runs": log, "rounds": rounds, "leftover_tmp": sorted({n for r in rounds for n in r["leftover_tmp"]}),
            "final": rounds[-1]["results"]}


def finished_round(out: Path) -> dict:
    """The results of a round that ran to its end and the temporary files it left; OUT is emptied for the next."""
    got = {"results": json.loads((out / "results.json").read_text()),
           "leftover_tmp": sorted(p.name for p in out.glob("results.json.*.tmp"))}
    shutil.rmtree(out)
    return got


def random_faults(rng: random.Random, count: int) -> list[tuple[str, float]]:
    """`count` faults, the kinds in equal shares and in random order (in a fixed cycle, the last kind of the cycle
    would always meet a run with little work left), each with its moment."""
    modes = [MODES[i % len(MODES)] for i in range(count)]
    rng.shuffle(modes)
    return [(m, rng.uniform(0.0, 0.3) if m == "random" else rng.random()) for m in modes]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=25, help="kills per evaluation (default 25)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the summary here (the reliability page's table reads it)")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    summary = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        env["HFPATCH_CACHE"] = str(tmp / "cache")
        model = save_sized(tmp / "model")
        docs = tmp / "docs"
        docs.mkdir()
        for i in range(12):
            (docs / f"d{i:02d}.txt").write_text(char_text(140, i), encoding="utf-8")
        commands = {
            "ppl": ["eval", "ppl", "--model", str(model), "--text-files", str(docs), "--lengths", "16,32,64",
                    "--patches", "none,ntk:2,yarn:2", "--windowing", "both", "--stride", "8", "--no-plot"],
            "passkey": ["eval", "passkey", "--model", str(model), "--lengths", "300,400,500", "--depths", "0,0.5,1",
                        "--trials", "3", "--patches", "none,ntk:2", "--new-tokens", "8", "--no-plot"],
        }
        for name, command in commands.items():
            t0 = time.time()
            assert child([*command, "--out", str(tmp / name / "whole")], "none:0", env)[0] == 0
            whole = json.loads((tmp / name / "whole" / "results.json").read_text())
            out = tmp / name / "killed"
            got = kill_and_resume([*command, "--out", str(out)], out, random_faults(rng, args.kills), env,
                                  saves_of(whole))
            summary[name] = summarize(got, whole, round(time.time() - t0, 1))
            print(f"{name}: {json.dumps(summary[name])}", flush=True)
    ok = all(s["equal_to_uninterrupted"] and not s["leftover_tmp"] and s["disk_full_one_line"] == s["by_mode"]["full"]
             and not s["disk_full_tmp_left"] for s in summary.values())
    print("all equal to the uninterrupted runs" if ok else "MISMATCH", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {"seed": args.seed, "kills_asked": args.kills, "machine": f"{os.cpu_count()} CPU cores, no GPU",
                  "evaluations": summary, "ok": ok}
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0 if ok else 1


def summarize(got: dict, whole: dict, seconds: float) -> dict:
    """What one evaluation's soak showed: the runs that a fault ended, by kind, and whether the last run's results
    equal the uninterrupted run's."""
    runs = got["runs"]
    full = [r for r in runs if r["mode"] == "full" and r["killed"]]
    return {"kills": sum(r["killed"] for r in runs), "runs": len(runs) + 1,
            "by_mode": {m: sum(r["killed"] for r in runs if r["mode"] == m) for m in MODES},
            "disk_full_one_line": sum(bool(r["one_line"]) for r in full),
            "disk_full_tmp_left": sorted({n for r in full for n in r["tmp_left"]}),
            "rounds": len(got["rounds"]),
            "resumed_runs_in_files": sum(len(r["results"].get("runs", [])) for r in got["rounds"]),
            "equal_to_uninterrupted": all(comparable(r["results"]) == comparable(whole) for r in got["rounds"]),
            "leftover_tmp": got["leftover_tmp"], "seconds": seconds}


if __name__ == "__main__":
    sys.exit(main())
