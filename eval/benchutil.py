"""Small helpers shared by the eval/bench_*.py scripts: memory of a process, workers in processes of their own
(`python -m eval.NAME --worker ...` from the repository root), timed forwards, command-line lengths; side-by-side
timing (hfpatch.utils.timing) and tables (hfpatch.evaluate.report) for the scripts."""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hfpatch
from hfpatch.evaluate.common import parse_lengths
from hfpatch.evaluate.report import markdown_table  # noqa: F401 (re-exported to the bench scripts)
from hfpatch.models import SMOLLM2, resolve
from hfpatch.utils.files import write_json, write_text
from hfpatch.utils.timing import interleaved  # noqa: F401 (re-exported to the bench scripts)

REPO = Path(__file__).resolve().parents[1]


def median(xs):
    return statistics.median(xs)


def length_list(text: str) -> list[int]:
    """An argparse type: '2k,8192' -> [2048, 8192], read as `hfpatch eval --lengths` reads it (sorted, no repeats);
    anything else is the command's one-line usage error."""
    try:
        return parse_lengths(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def module_name(file: str) -> str:
    """The module a script of this package runs as (`eval.bench_alibi` for eval/bench_alibi.py): what its workers
    start with `python -m`, however the script itself was started."""
    return f"{__package__}.{Path(file).stem}"


def reset_peak_rss() -> bool:
    """Reset this process's peak resident set (Linux: VmHWM), so that a later peak_rss() measures only what follows."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss() -> int:
    """Current resident set size in bytes."""
    kb = status_kb("VmRSS")
    return (kb or 0) * 1024


def peak_rss() -> int:
    """Peak resident set size in bytes since the start (or the last reset_peak_rss)."""
    kb = status_kb("VmHWM")
    if kb is None:
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb * 1024


def timed_forwards(model, length: int, repeats: int, vocab: int = 1000) -> dict:
    """Forwards of the base model on one sequence of `length` seeded random tokens, after a short warm-up: {"seconds":
    [per forward], "peak": peak RSS during them, "base": RSS before them} (for a worker process of its own)."""
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(1))
    times = []
    with torch.no_grad():
        model.model(ids[:, :256])  # warm-up of kernels and allocations
        base = rss()
        reset_peak_rss()
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.model(ids)
            times.append(time.perf_counter() - t0)
    return {"seconds": times, "peak": peak_rss(), "base": base}


def worker_command(module: str, argv: list[str]) -> list[str]:
    """`python -m MODULE ARGV` with this interpreter: a worker, started from the repository root (cwd=REPO)."""
    return [sys.executable, "-m", module, *argv]


def run_worker(module: str, argv: list[str]) -> dict:
    """Run `python -m MODULE ARGV` in a fresh process (its own peak memory) from the repository root, and parse the
    JSON it prints last."""
    out = subprocess.run(worker_command(module, argv), cwd=REPO, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"worker {module} {argv} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def smollm2_shaped(layers: int, max_positions: int):
    """SmolLM2-135M's architecture (its config, read from the embedded GGUF's metadata) with `layers` blocks and
    random weights, its window scaled with YaRN to cover max_positions."""
    where, gguf = resolve(SMOLLM2)
    config = AutoConfig.from_pretrained(where, gguf_file=gguf)
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    factor = max(2.0, 2 ** (max_positions - 1).bit_length() / config.max_position_embeddings)
    hfpatch.patch(model, position="yarn", factor=factor)
    return model


def int_options(p: argparse.ArgumentParser, **defaults: int) -> list[str]:
    """Add `--NAME` (an int; underscores written as dashes) with its default for each of `defaults`: the sizes a
    script passes on to its workers. Returns their names, for `passed_on`."""
    for name, default in defaults.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    return list(defaults)


def passed_on(args: argparse.Namespace, names: list[str]) -> list[str]:
    """`--NAME VALUE` for each of `names`: the options a worker is started with, as the script was given them."""
    return [part for name in names for part in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]


def parse_or_work(p: argparse.ArgumentParser, argv: list[str] | None, worker: Callable[[argparse.Namespace], dict],
                  variants: list[str] | None = None) -> argparse.Namespace | None:
    """The arguments of a script whose cells each run in a worker process of its own (run_worker): with the hidden
    `--worker VARIANT --length L` (VARIANT one of `variants`, if given) this process is such a worker, which prints
    worker(args)'s JSON and returns None."""
    p.add_argument("--worker", choices=variants, help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return None
    return args


def run_cells(module: str, cells: Iterable[tuple[str, int]], shape: list[str], args: argparse.Namespace,
              tables: Callable[[dict, argparse.Namespace], str]) -> str:
    """Each (variant, length) cell of `cells` in a worker process of `module` (`--worker VARIANT --length L` plus
    `shape`); a cell that fails (memory, a path refusing) is recorded with its error and the others still run.
    ARGS.out/bench.json is written after every cell, so a stopped run keeps what finished; ARGS.out/bench.md holds
    `tables(results, args)`, which is printed and returned."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    for v, L in cells:
        t0 = time.perf_counter()
        try:
            results[(v, L)] = run_worker(module, ["--worker", v, "--length", str(L), *shape])
        except RuntimeError as e:
            results[(v, L)] = {"error": str(e).strip().splitlines()[-1][:200]}
        print(f"{v} @ {L}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        write_json(out / "bench.json", {"args": {k: x for k, x in vars(args).items() if k not in ("worker", "length")},
                                        "cells": {f"{v}@{L}": r for (v, L), r in results.items()}})
    text = tables(results, args)
    write_text(out / "bench.md", text + "\n")
    print(text)
    return text


def worker_grid(module: str, lengths, variants_of, shape: list[str]) -> dict:
    """{(variant, L): the worker's JSON} for every length and each of `variants_of(L)`, each measured in a fresh
    process of `module` (`--worker VARIANT --length L` plus `shape`), so that every peak RSS is its own."""
    return {(v, L): run_worker(module, ["--worker", v, "--length", str(L), *shape])
            for L in lengths for v in variants_of(L)}
