"""Small helpers shared by the eval/bench_*.py scripts: memory of a process, workers in processes of their own,
timed forwards; side-by-side timing (hfpatch.utils.timing) and tables (hfpatch.evaluate.report) for the scripts."""

from __future__ import annotations

import json
import statistics
import time

from hfpatch.evaluate.report import markdown_table  # noqa: F401 (re-exported to the bench scripts)
from hfpatch.utils.timing import interleaved  # noqa: F401 (re-exported to the bench scripts)


def median(xs):
    return statistics.median(xs)


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
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb * 1024


def timed_forwards(model, length: int, repeats: int, vocab: int = 1000) -> dict:
    """Forwards of the base model on one sequence of `length` seeded random tokens, after a short warm-up: {"seconds":
    [per forward], "peak": peak RSS during them, "base": RSS before them} (for a worker process of its own)."""
    import torch

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


def run_worker(argv: list[str]) -> dict:
    """Run `python <argv>` in a fresh process (its own peak memory) and parse the JSON it prints last."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"worker {argv} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_json(path: str | None, result: dict) -> None:
    """Write a benchmark's result as JSON when --json was given."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def smollm2_shaped(layers: int, max_positions: int):
    """SmolLM2-135M's architecture (its config, read from the embedded GGUF's metadata) with `layers` blocks and
    random weights, its window scaled with YaRN to cover max_positions."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import hfpatch
    from hfpatch.models import SMOLLM2, resolve

    where, gguf = resolve(SMOLLM2)
    config = AutoConfig.from_pretrained(where, gguf_file=gguf)
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    factor = max(2.0, 2 ** (max_positions - 1).bit_length() / config.max_position_embeddings)
    hfpatch.patch(model, position="yarn", factor=factor)
    return model


def worker_grid(script: str, lengths, variants_of, shape: list[str]) -> dict:
    """{(variant, L): the worker's JSON} for every length and each of `variants_of(L)`, each measured in a fresh
    process of `script` (`--worker VARIANT --length L` plus `shape`), so that every peak RSS is its own."""
    return {(v, L): run_worker([script, "--worker", v, "--length", str(L), *shape])
            for L in lengths for v in variants_of(L)}
