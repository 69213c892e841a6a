"""How long the `hfpatch` command takes to answer `--help`, against starting Python itself, measured side by side.

    python -m eval.bench_cli                                   # this checkout
    python -m eval.bench_cli --vs /path/to/older/checkout --json out.json

Each command runs in a fresh process (`python -m hfpatch ...`, importing from the checkout named), every command
of every checkout interleaved round by round so that a machine that speeds up or slows down affects them alike; the
medians of wall and CPU (user + system) seconds are printed, with each command's ratio to `python -c pass`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = {
    "python -c pass": ["-c", "pass"],
    "hfpatch --help": ["-m", "hfpatch", "--help"],
    "hfpatch eval --help": ["-m", "hfpatch", "eval", "--help"],
    "hfpatch eval ppl --help": ["-m", "hfpatch", "eval", "ppl", "--help"],
}


def run_once(args: list[str], repo: Path) -> tuple[float, float]:
    """(wall, cpu) seconds of one fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1], help="checkout to import from")
    p.add_argument("--vs", type=Path, help="a second checkout, measured in the same rounds")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", type=Path, help="write the medians as JSON")
    args = p.parse_args(argv)
    repos = {"": args.repo, **({f" ({args.vs.name})": args.vs} if args.vs else {})}
    runs = {name + tag: (cmd, repo) for tag, repo in repos.items() for name, cmd in COMMANDS.items()
            if not (tag and name == "python -c pass")}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for cmd, repo in runs.values():  # warm-up: the page cache and .pyc files
        run_once(cmd, repo)
    for _ in range(args.rounds):
        for name, (cmd, repo) in runs.items():
            times[name].append(run_once(cmd, repo))
    base = statistics.median(w for w, _ in times["python -c pass"])
    rows = {name: {"wall_s": round(statistics.median(w for w, _ in t), 3),
                   "cpu_s": round(statistics.median(c for _, c in t), 3),
                   "wall_vs_python": round(statistics.median(w for w, _ in t) / base, 2)} for name, t in times.items()}
    print(f"| command | wall s (median of {args.rounds}) | CPU s | wall / python -c pass |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        print(f"| `{name}` | {r['wall_s']} | {r['cpu_s']} | {r['wall_vs_python']} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rounds": args.rounds, "python": sys.version.split()[0], "commands": rows},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
