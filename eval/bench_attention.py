"""What each attention path of the non-RoPE schemes costs: forward time and peak memory of a SmolLM2-shaped model
(d=576, 9 query heads, 3 KV heads, head_dim 64; fewer layers, random weights) for scheme x path x length, against
the unpatched model (RoPE, sdpa); and training steps (forward + backward) on the path the table picks for them.
Each cell runs in a fresh process of its own, so its peak memory (max RSS) is its own; ratios come from one run.

A path is forced for its cells (hfpatch.position.attention.paths.forcing); a path that cannot run here (CUDA,
flash-attn) is left out. For the compiled flex paths the first call (compilation included) is reported apart; the
timed forwards come after it. torch keeps compiled kernels in an on-disk cache, so a first call is slower on a fresh
machine than on one that compiled them before (--cold-compile disables that cache for the flex cells).

    python -m eval.bench_attention --threads 1                      # 2k, 8k, 16k; every path; 1-2 h
    python -m eval.bench_attention --lengths 2048 --repeats 1       # a quick check
    python -m eval.bench_attention --lengths 8192 --cells alibi/factorised,t5/pieces

With --device (cuda, or cpu for a quick check of the same code), every scheme runs the path the table chooses for
that device, dtype and mode, against the unpatched model on sdpa (and on flash-attn where it is installed), all
cells in one process, peak memory read from the device (CUDA: torch's allocator peak; CPU: peak RSS); a cell that
runs out of memory is recorded as such and the next one runs:

    python -m eval.bench_attention --device cuda --dtype bf16 --mode train --lengths 8192,32768,131072

On a CPU shared with other work, --neighbour busy runs a second process beside the cells that keeps one core busy
(one-thread matrix products), as another user's job would; with --threads 2 on a 2-core machine the cells then
compete with it:

    python -m eval.bench_attention --device cpu --threads 2 --lengths 8192 --repeats 3 \
        --out eval/results/attention/contention/idle
    python -m eval.bench_attention --device cpu --threads 2 --lengths 8192 --repeats 3 --neighbour busy \
        --out eval/results/attention/contention/busy

Writes OUT/bench.json (every cell's measurements) and OUT/bench.md (the tables), OUT = eval/results/attention.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import time

import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import hfpatch
from eval.benchutil import (
    REPO,
    length_list,
    markdown_table,
    median,
    module_name,
    parse_or_work,
    peak_rss,
    reset_peak_rss,
    rss,
    run_cells,
    timed_forwards,
)
from hfpatch.position.attention import fa4, flex, kernels, paths

GB = 1024**3
THETA = 1e5
# scheme -> (patch options, the paths that run on a CPU; the CUDA and flash-attn paths are checked by the tests)
SCHEMES = {
    "alibi": ({}, ["factorised", "flex", "written-out"]),
    "t5": ({}, ["pieces", "flex", "written-out"]),
    "xl": ({}, ["widened", "written-out"]),
    "self-extend": ({"group_size": 8, "window": 1024}, ["pieces", "written-out"]),
}
TRAINED = 8192  # the model's trained window (Self-Extend's W must be inside it)
# --device: every scheme with attention paths of its own (hfpatch.position.attention.paths), its path chosen per call
CHOSEN = {**{scheme: options for scheme, (options, _) in SCHEMES.items()}, "dual-chunk": {}}
WINDOWED = {"self-extend", "dual-chunk"}  # keep the trained window: the scheme reaches beyond it
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
MODULE = module_name(__file__)  # what the workers run as


# --device: the floors, the unpatched model on the kernels the schemes run on, with nothing modified: flex_attention
# with only the causal block mask (the Triton kernels of the flex paths) and FlashAttention-4 causal (the fa4 paths).
# A scheme's cost is read against the floor of its kernel family as well as against sdpa.
FLOORS = {"flex": "hfpatch_bench_flex_floor", "fa4": "hfpatch_bench_fa4_floor"}


def _flex_floor(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Causal flex_attention, no score_mod (the bench's batches have no padding)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    mask = flex.block_mask(flex.CAUSAL, q_len, kv_len, query.device)
    return flex.attention(query, key, value, scaling, None, mask).transpose(1, 2).contiguous(), None


def _fa4_floor(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """One causal FlashAttention-4 call, no score_mod."""
    out, _ = fa4.attend(query, key, value, scaling, causal=True)
    return out.transpose(1, 2).contiguous(), None


for _name, _fn in ((FLOORS["flex"], _flex_floor), (FLOORS["fa4"], _fa4_floor)):
    AttentionInterface.register(_name, _fn)
    AttentionMaskInterface.register(_name, sdpa_mask)


def floor_refusal(kind: str, args) -> str | None:
    """Why the floor of `kind` cannot be measured here, or None."""
    if kind == "fa4":
        return fa4.missing()
    if args.mode == "train" and not args.device.startswith("cuda"):
        return "flex_attention has no backward pass on the CPU"
    return None


def build(scheme: str, layers: int, length: int, attn: str | None = None):
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=1000,
                         max_position_embeddings=TRAINED if scheme in WINDOWED else max(length, TRAINED),
                         rope_parameters={"rope_type": "default", "rope_theta": THETA})
    if attn is not None:  # as if loaded with attn_implementation=attn
        config._attn_implementation_internal = attn
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    if scheme != "unpatched":
        hfpatch.patch(model, position=scheme, **CHOSEN[scheme])
    if scheme == "t5":  # zero at start: give the buckets values, as after training
        with torch.no_grad():
            model.model.hfpatch_t5_bias.weight.normal_(0.0, 1.0)
    return model


def timed_train(model, length: int, repeats: int, vocab: int = 1000) -> dict:
    """Training steps (forward, loss, backward) on one sequence, like timed_forwards."""
    model.train()
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(1))
    model(ids[:, :256], labels=ids[:, :256]).loss.backward()  # warm-up
    model.zero_grad(set_to_none=True)
    base = rss()
    reset_peak_rss()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return {"seconds": times, "peak": peak_rss(), "base": base}


def worker(args) -> dict:
    """One cell: VARIANT is "unpatched", "SCHEME/PATH" (inference, the path forced) or "train:SCHEME" (training, the
    path the table picks)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    train = args.worker.startswith("train:")
    variant = args.worker.removeprefix("train:")
    scheme, _, path = variant.partition("/")
    model = build(scheme, args.layers, args.length)
    paths.reset(model)  # not the patch's own check
    forced = paths.forcing(scheme, path) if path else contextlib.nullcontext()
    with forced:
        if train:
            out = timed_train(model, args.length, args.repeats)
        else:
            out = timed_forwards(model, args.length, args.repeats)
    out["ran"] = paths.ran(model)
    out["first_call"] = flex.timings().get("first call")
    out["threads"] = torch.get_num_threads()
    return out


def cells(lengths, chosen, train_lengths) -> list[tuple[str, int]]:
    grid = []
    for L in lengths:
        grid.append(("unpatched", L))
        for scheme, (_, cpu_paths) in SCHEMES.items():
            grid += [(f"{scheme}/{p}", L) for p in cpu_paths if chosen is None or f"{scheme}/{p}" in chosen]
    for L in train_lengths:
        grid.append(("train:unpatched", L))
        grid += [(f"train:{s}", L) for s in SCHEMES if chosen is None or f"train:{s}" in chosen]
    return grid


def tables(results: dict, args) -> str:
    def t(v, L):
        return median(results[(v, L)]["seconds"])

    rows, train_rows = [], []
    for (v, L), r in results.items():
        train = v.startswith("train:")
        base = ("train:unpatched" if train else "unpatched", L)
        if "error" in r:
            (train_rows if train else rows).append([L, v, r["error"], "", "", "", "", "", ""])
            continue
        ran = ", ".join(f"{k} x{n}" for k, n in sorted(r["ran"].items())) or "sdpa (the model's own)"
        row = [L, v.removeprefix("train:"), f"{t(v, L):.2f}",
               f"{t(v, L) / t(*base):.2f}" if base in results and "error" not in results[base] else "",
               f"{r['peak'] / GB:.2f}", f"{(r['peak'] - r['base']) / GB:.2f}",
               f"{r['peak'] / results[base]['peak']:.2f}" if base in results and "error" not in results[base] else "",
               "" if r.get("first_call") is None else f"{r['first_call']:.1f}", ran]
        (train_rows if train else rows).append(row)
    head = ["L", "scheme/path", "seconds", "time / unpatched", "peak RSS (GB)", "peak above steady state (GB)",
            "peak / unpatched", "first call (s)", "calls per path"]
    threads = next((r["threads"] for r in results.values() if "threads" in r), "?")
    text = [f"SmolLM2-shaped Llama (d=576, 9/3 heads, head_dim 64), {args.layers} layers, random weights; batch 1, "
            f"median of {args.repeats}; {threads} threads; peak = process peak RSS during the timed calls "
            "(each cell its own process). Self-Extend: G=8, W=1024; T5: 32 buckets, max_distance 128.", "",
            "Inference (forward of the base model, no gradients), the path forced:", markdown_table(head, rows)]
    if train_rows:
        text += ["", "Training (forward + loss + backward), the path the table picks (inference-only paths step "
                 "aside):", markdown_table(head, train_rows)]
    return "\n".join(text)


# ------------------------------------------------------------------ --device: the chosen paths, in one process

def flash_schemes() -> list[str]:
    """The schemes with a path for models loaded with attn_implementation="flash_attention_2" (read off the path
    tables)."""
    return [s for s in CHOSEN if any(p.base and "flash_attention_2" in p.base for p in paths.table(s))]


def device_variants() -> list[str]:
    """"unpatched" (sdpa), the floors ("floor:flex", "floor:fa4": the unpatched model on those kernels), every
    scheme, then "flash:unpatched" and "flash:SCHEME" (models loaded with flash-attn, for the schemes with a
    flash-attn path)."""
    return ["unpatched", *(f"floor:{k}" for k in FLOORS), *CHOSEN, "flash:unpatched",
            *(f"flash:{s}" for s in flash_schemes())]


class DeviceMemory:
    """Peak memory of the timed calls on one device: torch's CUDA allocator, or the process's RSS on the CPU."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def reset(self) -> int:
        """Start measuring; returns what is held now (the model, its inputs)."""
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()
        reset_peak_rss()
        return rss()

    def peak(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_allocated()
        return peak_rss()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _step(model, ids, train: bool) -> None:
    """One forward of the base model (infer), or forward + loss + backward (train)."""
    if train:
        model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
    else:
        with torch.no_grad():
            model.model(ids)


def device_cell(variant: str, length: int, args) -> dict:
    """One cell of the --device grid: the first call at `length` (compilation included) apart, then the timed ones."""
    base, _, scheme = variant.rpartition(":")
    memory = DeviceMemory(args.device)
    attn = "flash_attention_2" if base == "flash" else FLOORS[scheme] if base == "floor" else None
    model = build("unpatched" if base == "floor" else scheme, args.layers, length, attn=attn)
    model.to(args.device, getattr(torch, DTYPES[args.dtype]))
    train = args.mode == "train"
    model.train(train)
    ids = torch.randint(0, 1000, (1, length), generator=torch.Generator().manual_seed(1)).to(args.device)
    _step(model, ids[:, :256], train)  # warm-up of kernels and allocations
    paths.reset(model)
    held = memory.reset()
    times = []
    for _ in range(1 + args.repeats):
        t0 = time.perf_counter()
        _step(model, ids, train)
        memory.sync()
        times.append(time.perf_counter() - t0)
    return {"seconds": times[1:], "first_call": times[0], "peak": memory.peak(), "base": held,
            "ran": paths.ran(model)}


def out_of_memory(error: BaseException) -> bool:
    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in str(error).lower()


def device_grid(args, save) -> dict:
    """{(variant, L): measurements, or {"error": ...} or {"skipped": why}}, cells run in order of length; stops
    starting cells once --budget-s is spent (the rest say so). `save(results)` runs after every cell."""
    no_flash = kernels.flash_attn_missing()
    results: dict = {}
    start = time.perf_counter()
    for L in args.lengths:
        for v in device_variants():
            t0 = time.perf_counter()
            floor = v.startswith("floor:") and floor_refusal(v.partition(":")[2], args)
            if v.startswith("flash:") and no_flash:
                results[(v, L)] = {"skipped": no_flash}
            elif floor:
                results[(v, L)] = {"skipped": floor}
            elif args.budget_s and t0 - start > args.budget_s:
                results[(v, L)] = {"skipped": f"the time budget of {args.budget_s:.0f} s was spent"}
            else:
                try:
                    results[(v, L)] = device_cell(v, L, args)
                except Exception as e:  # one cell failing (memory, a path refusing) does not lose the others
                    results[(v, L)] = {"error": "out of memory" if out_of_memory(e)
                                       else f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"}
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            print(f"{v} @ {L}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
            save(results)
    return results


def device_tables(results: dict, args, unmeasured: str = "not measured in this run") -> str:
    """The grid as a table: each variant's time and peak memory against unpatched sdpa and against the two floors
    (the unpatched model on flex_attention and on FlashAttention-4); a floor that has no cell in `results` reads
    `unmeasured`, one that was skipped or failed "-"."""
    what = "forward + loss + backward" if args.mode == "train" else "forward of the base model"
    bases = [("unpatched", "sdpa"), ("floor:flex", "flex"), ("floor:fa4", "fa4")]
    head = ["L", "variant", "path (calls)", "seconds", *(f"time / {n}" for _, n in bases), "peak (GB)",
            *(f"peak / {n}" for _, n in bases), "first call (s)"]
    rows = []
    for (v, L), r in results.items():
        if "seconds" not in r:
            rows.append([L, v, r.get("error") or f"skipped: {r['skipped']}", *[""] * (len(head) - 3)])
            continue

        def ratio(key: str, field: str, L: int = L, r: dict = r) -> str:
            base = results.get((key, L))
            if base is None:
                return unmeasured
            if "seconds" not in base:
                return "-"
            mine, theirs = (median(x["seconds"]) if field == "seconds" else x["peak"] for x in (r, base))
            return f"{mine / theirs:.2f}"

        kernel = {"floor:flex": "flex_attention", "floor:fa4": "FlashAttention-4"}.get(v, "the model's own")
        ran = ", ".join(f"{k} x{n}" for k, n in sorted(r["ran"].items())) or kernel
        rows.append([L, v, ran, f"{median(r['seconds']):.3f}", *(ratio(k, "seconds") for k, _ in bases),
                     f"{r['peak'] / GB:.2f}", *(ratio(k, "peak") for k, _ in bases), f"{r['first_call']:.1f}"])
    return "\n".join([
        f"SmolLM2-shaped Llama (d=576, 9/3 heads, head_dim 64), {args.layers} layers, random weights; batch 1; "
        f"{args.device}, {args.dtype}, {args.mode} ({what}); "
        + ("" if args.device.startswith("cuda") else f"{args.threads or torch.get_num_threads()} threads"
           + (", a busy neighbour process beside it; " if args.neighbour else "; ")) +
        f"median of {args.repeats} after a first call at the length (reported apart: compilation included); "
        "the path each scheme's table chooses; the floors: the unpatched model on flex_attention with only the causal "
        "mask (floor:flex) and on FlashAttention-4 with no score_mod (floor:fa4); peak = "
        + ("torch's CUDA allocator peak during the timed calls." if args.device.startswith("cuda")
           else "process peak RSS during the timed calls."),
        "", markdown_table(head, rows)])


def check_device(p: argparse.ArgumentParser, args) -> None:
    """--device must name a device this machine has; fills in the --device grid's defaults."""
    if args.device not in ("cpu", "cuda"):
        p.error(f"--device {args.device}: expected cuda or cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here (--device cpu runs the same cells on the CPU)")
    args.dtype = args.dtype or "fp32"
    args.mode = args.mode or "infer"


# The busy neighbour: one thread of matrix products, forever (the parent kills it).
BUSY = "import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\nwhile True:\n    a @ a\n"


@contextlib.contextmanager
def neighbour(kind: str | None):
    """With kind "busy", a second process keeps one core busy for the duration of the block."""
    if kind is None:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", BUSY], env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        time.sleep(2.0)  # past its start-up, so that the cells meet it busy
        yield
    finally:
        proc.kill()
        proc.wait()


def run_device_grid(args) -> None:
    os.makedirs(args.out, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)

    def save(results):
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump({"args": vars(args), "cells": {f"{v}@{L}": r for (v, L), r in results.items()}}, f, indent=1)

    with neighbour(args.neighbour):
        results = device_grid(args, save)
    text = device_tables(results, args)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(text + "\n")
    print(text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=length_list, default=[2048, 8192, 16384])
    p.add_argument("--train-lengths", type=length_list, default=[2048],
                   help="lengths of the training cells (written-out training keeps every block's weights)")
    p.add_argument("--cells", help="only these cells, e.g. alibi/flex,t5/pieces,train:t5 (unpatched always runs)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, help="torch threads per cell (default: torch's own choice); 1 gives steadier "
                   "ratios on a machine shared with other work")
    p.add_argument("--cold-compile", action="store_true", help="compile without torch's on-disk cache (the flex "
                   "cells' first call then shows what a fresh machine pays)")
    p.add_argument("--device", help="cuda or cpu: the path each scheme chooses there, against unpatched sdpa (and "
                   "flash-attn where installed), all cells in one process (see above)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="with --device: the model's dtype (default fp32)")
    p.add_argument("--mode", choices=["infer", "train"], help="with --device: forwards (infer, the default), "
                   "or training steps (forward + loss + backward)")
    p.add_argument("--neighbour", choices=["busy"], help="with --device cpu: a second process keeps one core busy "
                   "while the cells run")
    p.add_argument("--budget-s", type=float, help="with --device: start no cell after this many seconds")
    p.add_argument("--out", default=str(REPO / "eval" / "results" / "attention"))
    args = parse_or_work(p, argv, worker)
    if args is None:
        return
    if args.device:
        check_device(p, args)
        run_device_grid(args)
        return
    given = [f"--{k.replace('_', '-')}" for k in ("dtype", "mode", "budget_s", "neighbour")
             if getattr(args, k) is not None]
    if given:
        p.error(f"{', '.join(given)}: only with --device cuda|cpu")

    chosen = None if args.cells is None else set(args.cells.split(","))
    shape = ["--layers", str(args.layers), "--repeats", str(args.repeats)] + \
        (["--threads", str(args.threads)] if args.threads else [])
    if args.cold_compile:
        os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
    run_cells(MODULE, cells(args.lengths, chosen, args.train_lengths), shape, args, tables)


if __name__ == "__main__":
    main()
