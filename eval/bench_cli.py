"""How long the `hfpatch` command takes to answer: `--help` of the command and of each subcommand (read off its
parser), or `hfpatch describe smollm2` with the GGUF cache cold and warm (--describe), against starting Python itself,
measured side by side.

    python -m eval.bench_cli                                   # this checkout
    python -m eval.bench_cli --vs /path/to/older/checkout --json out.json
    python -m eval.bench_cli --describe --vs /path/to/older/checkout --json out.json

Each command runs in a fresh process (`python -m hfpatch ...`, importing from the checkout named), every command
of every checkout interleaved round by round so that a machine that speeds up or slows down affects them alike; the
medians of wall and CPU (user + system) seconds are printed, with each command's ratio to `python -c pass`.

With --describe, each run has a cache folder ($HFPATCH_CACHE) of its own: "cold" an empty one for every run (the
first load of the model on a machine: the GGUF file converted and cached), "warm" one filled by the warm-up run (every
later load). The checkout compared (--vs) runs with an empty one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PYTHON = ("python -c pass", ["-c", "pass"], None)
DESCRIBE = ["-m", "hfpatch", "describe", "smollm2"]


def help_commands() -> list[tuple[str, list[str], str | None]]:
    """(name, python arguments, cache) of every --help measured: the command's, each subcommand's (read off the
    parser of this checkout), and one evaluation's own."""
    import argparse as ap

    from hfpatch.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, ap._SubParsersAction)]
    rows = [("hfpatch --help", ["-m", "hfpatch", "--help"], None)]
    rows += [(f"hfpatch {name} --help", ["-m", "hfpatch", name, "--help"], None) for name in sub.choices]
    return [PYTHON, *rows, ("hfpatch eval ppl --help", ["-m", "hfpatch", "eval", "ppl", "--help"], None)]


def describe_commands() -> list[tuple[str, list[str], str | None]]:
    return [PYTHON, ("hfpatch describe smollm2 (cache cold)", DESCRIBE, "cold"),
            ("hfpatch describe smollm2 (cache warm)", DESCRIBE, "warm")]


def run_once(args: list[str], repo: Path, cache: Path | None = None) -> tuple[float, float]:
    """(wall, cpu) seconds of one fresh process (with $HFPATCH_CACHE = `cache` where given)."""
    env = {**os.environ, "PYTHONPATH": str(repo)}
    if cache is not None:
        env["HFPATCH_CACHE"] = str(cache)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def timed(args: list[str], repo: Path, cache: str | None, scratch: Path, name: str) -> tuple[float, float]:
    """run_once with the row's cache folder: a new empty one ("cold"), the row's own kept one ("warm"), or none."""
    if cache == "cold":
        folder = Path(tempfile.mkdtemp(dir=scratch))
        try:
            return run_once(args, repo, folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    if cache == "warm":
        return run_once(args, repo, scratch / name.replace(" ", "_"))
    return run_once(args, repo)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1], help="checkout to import from")
    p.add_argument("--vs", type=Path, help="a second checkout, measured in the same rounds")
    p.add_argument("--describe", action="store_true",
                   help="time `hfpatch describe smollm2` with the GGUF cache cold and warm instead of --help")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", type=Path, help="write the medians as JSON")
    args = p.parse_args(argv)
    commands = describe_commands() if args.describe else help_commands()
    runs = {name: (cmd, args.repo, cache) for name, cmd, cache in commands}
    if args.vs:  # the other checkout's: each command once (with an empty cache folder where a cache is used)
        seen = set()
        for name, cmd, cache in commands:
            label = (name.split(" (")[0] if cache else name) + f" ({args.vs.name})"
            if cmd != PYTHON[1] and label not in seen:
                seen.add(label)
                runs[label] = (cmd, args.vs, "cold" if cache else None)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory(prefix="bench_cli-") as scratch:
        for name, (cmd, repo, cache) in runs.items():  # warm-up: the page cache, .pyc files, the warm cache folder
            timed(cmd, repo, cache, Path(scratch), name)
        for _ in range(args.rounds):
            for name, (cmd, repo, cache) in runs.items():
                times[name].append(timed(cmd, repo, cache, Path(scratch), name))
    base = statistics.median(w for w, _ in times[PYTHON[0]])
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
