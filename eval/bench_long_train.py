"""The longest sequence whose full fine-tuning step (forward, backward, AdamW) fits a memory budget:
transformers.Trainer with gradient checkpointing vs the recipe's loop with its memory options, side by side in one
run, on a SmolLM2-shaped model (SmolLM2-135M's config with fewer blocks, random weights, batch 1, fp32).

    python -m eval.bench_long_train --budget-gb 3.0                   # 8 blocks; bisection to 512 tokens
    python -m eval.bench_long_train --budget-gb 3.0 --layers 30       # SmolLM2-135M's full depth

Each measurement is one step in a fresh process of this script, AdamW's moments already allocated (as in every step
but a run's first); its memory is the process's peak resident set
(VmHWM, read from outside while it runs and ru_maxrss at its end), so it counts everything the step needs, Python
and the loaded model included. A process whose peak passes the budget is stopped there: it does not fit.

The search: lengths double from --start until a step does not fit, then bisection between the last length that
fit and the first that did not, down to --resolution tokens. Then both variants run --timing-steps steps at the
longest length both fit (the first step untimed) for tokens/s. The floor: what any step must keep at that length
(parameters, gradients, AdamW's two moments, every block's checkpointed input and the final hidden state), plus
the largest piece one recomputation needs; each measured peak is reported against it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

import torch
from transformers import AutoConfig

from eval.benchutil import REPO, markdown_table, module_name, smollm2_shaped, worker_command
from hfpatch.models import SMOLLM2, resolve
from hfpatch.utils.files import write_json

GB = 1024**3
MODULE = module_name(__file__)  # what the workers run as


# ------------------------------------------------------------------------------------------------------ workers

def _tokens(vocab: int, length: int, rows: int = 1):
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(0))


def warm_optimizer(optimizer, params) -> None:
    """Give AdamW its two moments before the measured step, as every step after a run's first has them: one step
    on zero gradients (no weight decay here), which leaves the weights as they are."""
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def recipe_overrides(args, length: int, out: str) -> list[str]:
    """The recipe's configuration in this benchmark (the same keys a user puts in the YAML)."""
    return [f"seq_len={length}", "batch_size=1", f"max_steps={args.steps}", "warmup_steps=1", "lr=1e-4",
            "gradient_checkpointing=true", f"mlp_tile={args.mlp_tile}", f"fused_optimizer={str(args.fused).lower()}",
            "fused_loss=true", f"release_memory={str(args.release).lower()}",
            f"output_dir={out}", "model=smollm2"] + ([f"loss_chunk={args.loss_chunk}"] if args.loss_chunk else [])


def recipe_worker(args) -> dict:
    # each loop's code only in its own worker: a process's peak memory is the step's, not the other loop's imports
    from hfpatch.train import loop
    from hfpatch.train.config import load

    model = smollm2_shaped(args.layers, args.max_len)
    with tempfile.TemporaryDirectory() as out:
        cfg = load("context_extension", None, recipe_overrides(args, args.length, out))
        run = loop.prepare(cfg, model)
        warm_optimizer(run.optimizer, run.params)
        seqs = _tokens(model.config.vocab_size, args.length, args.steps)
        times, losses = [], []
        for step in range(args.steps):
            t0 = time.perf_counter()
            totals = loop.train_step(cfg, run, seqs, step)
            losses.append(totals[0].item())
            times.append(time.perf_counter() - t0)
    return {"times": times, "losses": losses}


def trainer_worker(args) -> dict:
    # each loop's code only in its own worker: a process's peak memory is the step's, not the other loop's imports
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model = smollm2_shaped(args.layers, args.max_len)
    seqs = _tokens(model.config.vocab_size, args.length, args.steps)

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(seqs)

        def __getitem__(self, i):
            return {"input_ids": seqs[i], "labels": seqs[i]}

    marks, losses = [time.perf_counter()], []

    class Clock(TrainerCallback):
        def on_train_begin(self, a, state, control, optimizer=None, model=None, **kw):
            warm_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad])
            marks[0] = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            marks.append(time.perf_counter())

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(output_dir=out, per_device_train_batch_size=1, max_steps=args.steps,
                                  learning_rate=1e-4, warmup_steps=1, lr_scheduler_type="cosine",
                                  gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
                                  optim="adamw_torch_fused" if args.fused else "adamw_torch", logging_steps=1,
                                  save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0, seed=0,
                                  disable_tqdm=True)
        trainer = Trainer(model=model, args=targs, train_dataset=Rows(), callbacks=[Clock()])
        trainer.train()
    return {"times": [b - a for a, b in pairwise(marks)], "losses": losses}


# ------------------------------------------------------------------------------------------------------ parent

def _hwm_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


# what each measured variant runs: (worker, environment, worker arguments). "trainer, malloc 1 MiB" gives Trainer the
# allocator setting the recipe's release_memory sets from inside (glibc's mmap threshold fixed at 1 MiB), through the
# environment. "recipe, no release_memory" is the recipe with that one option off: what the allocator setting costs.
VARIANTS = {"trainer": ("trainer", {}, []),
            "trainer, malloc 1 MiB": ("trainer", {"MALLOC_MMAP_THRESHOLD_": "1048576"}, []),
            "recipe": ("recipe", {}, []), "recipe, no release_memory": ("recipe", {}, ["--no-release"]),
            "idle": ("idle", {}, [])}


def measure(args, variant: str, length: int, steps: int, budget: int | None) -> dict:
    """One fresh process: `steps` steps at `length`. Stopped as soon as its peak passes `budget` bytes."""
    worker, env, extra = VARIANTS[variant]
    cmd = worker_command(MODULE, ["--worker", worker, "--length", str(length), "--steps", str(steps), "--layers",
                                  str(args.layers), "--max-len", str(args.max_len), "--mlp-tile", str(args.mlp_tile),
                                  "--loss-chunk", str(args.loss_chunk or 0), *extra,
                                  *([] if args.fused else ["--no-fused"])])
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, cwd=REPO, env={**os.environ, **env})
        peak_kb, over = 0, False
        while proc.poll() is None:
            peak_kb = max(peak_kb, _hwm_kb(proc.pid))
            if budget is not None and peak_kb * 1024 > budget:
                proc.kill()
                proc.wait()
                over = True
                break
            time.sleep(0.05)
        seconds = time.perf_counter() - t0
        if over:
            return {"variant": variant, "length": length, "fits": False, "peak_gb": peak_kb / 2**20, "stopped": True,
                    "seconds": seconds}
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise SystemExit(f"{variant} worker at {length} failed:\n{err.read()[-3000:]}")
        result = json.loads(out.read().strip().splitlines()[-1])
    peak = max(result["max_rss_kb"], peak_kb) * 1024
    return {"variant": variant, "length": length, "fits": budget is None or peak <= budget, "peak_gb": peak / GB,
            "stopped": False, "seconds": seconds, **result}


def longest(args, variant: str, start: int, budget: int, log: list) -> tuple[int, dict]:
    """The longest length that fits, to args.resolution: doubling from `start` until a step does not fit, then
    bisection between the last length that fit and the first that did not. Each new probe is placed where the
    straight line through the two longest steps that fit reaches the budget (the peak grows about linearly with
    the length), so that the long, slow probes are few; where that point is outside the bracket, or the last probe
    did not fit, the probe is the bracket's middle."""
    def probe(length):
        m = measure(args, variant, length, 1, budget)
        log.append(m)
        print(f"  {variant:22s} {length:7d} tokens: {'fits' if m['fits'] else 'does not fit'} "
              f"(peak {m['peak_gb']:.2f} GB{', stopped' if m['stopped'] else ''}, {m['seconds']:.0f} s)",
              file=sys.stderr, flush=True)
        return m

    fits: list[tuple[int, dict]] = []
    miss, length = None, start
    while miss is None:
        if length > args.max_len:
            raise SystemExit(f"{variant} still fits at --max-len {args.max_len}: raise it or lower the budget")
        m = probe(length)
        if m["fits"]:
            fits.append((length, m))
            length *= 2
        else:
            miss = length
    if not fits:
        raise SystemExit(f"{variant} does not fit {start} tokens in {args.budget_gb} GB: lower the start length")
    r = args.recipe_resolution if variant == "recipe" and args.recipe_resolution else args.resolution
    last_fit = True
    while miss - fits[-1][0] > r:
        fit = fits[-1][0]
        mid = (fit + miss) // 2
        # the straight line only where it lands inside the bracket, and not right after a miss: otherwise plain
        # bisection, so that a line that overshoots (the peak grows a little faster than linearly) halves the
        # bracket instead of creeping down from the miss by `r` a probe
        if len(fits) >= 2 and last_fit:
            (l0, m0), (l1, m1) = fits[-2], fits[-1]
            slope = (m1["peak_gb"] - m0["peak_gb"]) / (l1 - l0)
            if slope > 0:
                line = int(l1 + (budget / GB - m1["peak_gb"]) / slope)
                mid = line if fit < line < miss else mid
        mid = min(max(mid // r * r, fit + r), miss - r)
        m = probe(mid)
        last_fit = m["fits"]
        if m["fits"]:
            fits.append((mid, m))
        else:
            miss = mid
    return fits[-1]


def floor_bytes(config, length: int, idle: dict, layers: int) -> dict:
    """What any full fine-tuning step at `length` must hold at its peak (fp32).

    The process with its model loaded (measured: `idle`), the parameters' gradients and AdamW's two moments, each
    block's checkpointed input and the final hidden state ((layers + 1) x hidden floats per token, kept between the
    forward and the backward pass), plus the largest piece one recomputation must hold at once that grows with the
    length: a block's attention, q, k, v and its output (the MLP's tile and the loss's chunk do not grow)."""
    d, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    fixed = idle["max_rss_kb"] * 1024 + 3 * idle["n_params"] * 4
    per_token = (layers + 1) * d * 4 + (2 * d + 2 * kv) * 4
    return {"fixed": fixed, "per_token": per_token, "total": fixed + length * per_token}


def idle_worker(args) -> dict:
    model = smollm2_shaped(args.layers, args.max_len)
    return {"n_params": sum(p.numel() for p in model.parameters())}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-gb", type=float, default=3.0, dest="budget_gb",
                   help="peak resident memory of the whole process, GiB")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--start", type=int, default=1024, help="Trainer's first length (doubling from there)")
    p.add_argument("--recipe-start", type=int, default=4096, dest="recipe_start", help="the recipe's first length")
    p.add_argument("--resolution", type=int, default=512, help="bisection stops at this many tokens")
    p.add_argument("--recipe-resolution", type=int, default=None, dest="recipe_resolution",
                   help="the recipe's bisection stops at this many tokens (default: --resolution)")
    p.add_argument("--max-len", type=int, default=131072, dest="max_len",
                   help="longest length tried; the model's YaRN window covers it")
    p.add_argument("--mlp-tile", type=int, default=2048, dest="mlp_tile")
    p.add_argument("--loss-chunk", type=int, default=None, dest="loss_chunk",
                   help="the recipe's loss_chunk (default: its auto rule)")
    p.add_argument("--no-fused", dest="fused", action="store_false",
                   help="for-each-tensor AdamW on both sides (default: fused AdamW on both, Trainer's default)")
    p.add_argument("--timing-steps", type=int, default=3, dest="timing_steps")
    p.add_argument("--timing-length", type=int, default=None, dest="timing_length",
                   help="length of the tokens/s comparison (default: the longest both fit)")
    p.add_argument("--long-timing-length", type=int, default=None, dest="long_timing_length",
                   help="also time the recipe with and without release_memory at this length (2 steps, the first "
                        "untimed): what the allocator setting costs where only the recipe fits")
    p.add_argument("--json")
    p.add_argument("--worker", choices=["recipe", "trainer", "idle"], help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--no-release", dest="release", action="store_false", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.loss_chunk == 0:
        args.loss_chunk = None
    if args.worker:
        result = {"recipe": recipe_worker, "trainer": trainer_worker, "idle": idle_worker}[args.worker](args)
        result["max_rss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps(result))
        return None

    budget = int(args.budget_gb * GB)
    idle = measure(args, "idle", 0, 0, None)
    log: list[dict] = []
    best = {v: longest(args, v, args.recipe_start if v == "recipe" else args.start, budget, log)
            for v in ("trainer", "trainer, malloc 1 MiB", "recipe")}
    both = args.timing_length or min(best["trainer"][0], best["trainer, malloc 1 MiB"][0])

    def timed(variant, length, steps):
        m = measure(args, variant, length, steps, None)
        times = m["times"][1:]
        return {"tokens_per_s": length * len(times) / sum(times), "peak_gb": m["peak_gb"], "losses": m["losses"]}

    timing = {v: timed(v, both, args.timing_steps) for v in ("trainer", "trainer, malloc 1 MiB", "recipe",
                                                              "recipe, no release_memory") if args.timing_steps}
    long_timing = {v: timed(v, args.long_timing_length, 2) for v in ("recipe", "recipe, no release_memory")
                   if args.long_timing_length}
    where, gguf = resolve(SMOLLM2)
    result = {"args": vars(args), "idle": idle, "longest": {v: {"length": b[0], **b[1]} for v, b in best.items()},
              "ratio": best["recipe"][0] / max(best["trainer"][0], best["trainer, malloc 1 MiB"][0]),
              "timing_length": both, "timing": timing, "long_timing": long_timing, "probes": log}
    print(tables(result, AutoConfig.from_pretrained(where, gguf_file=gguf)))
    if args.json:
        write_json(Path(args.json), result)
    return result


def tables(result: dict, config) -> str:
    """The printed report of a run (the --json form: also what eval/docs_tables.py renders); `config` is the
    SmolLM2 config the model was shaped on (hidden_size, num_key_value_heads, head_dim: for the floor)."""
    args, idle, both = result["args"], result["idle"], result["timing_length"]
    timing, long_timing = result["timing"], result["long_timing"]
    rows = []
    for variant, m in result["longest"].items():
        floor = floor_bytes(config, m["length"], idle, args["layers"])
        rows.append([variant, m["length"], f"{m['peak_gb']:.2f}", f"{floor['total'] / GB:.2f}",
                     f"{m['peak_gb'] * GB / floor['total']:.2f}", f"{m['times'][0]:.0f}"])
    out = [f"process with the model loaded: {idle['peak_gb']:.2f} GB; floor per token "
           f"{floor_bytes(config, 0, idle, args['layers'])['per_token'] / 1024:.1f} KiB",
           f"SmolLM2 shape, {args['layers']} blocks, fp32, batch 1; budget {args['budget_gb']} GiB of peak RSS per "
           f"process; recipe: gradient checkpointing, mlp_tile {args['mlp_tile']}, fused_loss (chunks of "
           f"{args['loss_chunk'] or 512}), release_memory, {'fused' if args['fused'] else 'for-each'} AdamW (Trainer: "
           f"{'adamw_torch_fused' if args['fused'] else 'adamw_torch'}, gradient checkpointing)",
           markdown_table(["loop", "longest step that fits (tokens)", "its peak RSS (GB)",
                           "floor at that length (GB)", "peak / floor", "step (s)"], rows),
           f"\nlongest sequence, recipe / Trainer's longer: {result['ratio']:.1f}x"]
    if timing:
        rc = timing["recipe"]["tokens_per_s"]
        out.append(markdown_table(["loop", f"tokens/s at {both} tokens", "recipe / this", "peak RSS (GB)"],
                                  [[v, f"{t['tokens_per_s']:.1f}", f"{rc / t['tokens_per_s']:.3f}",
                                    f"{t['peak_gb']:.2f}"] for v, t in timing.items()]))
        tr, off = timing["trainer"]["tokens_per_s"], timing["recipe, no release_memory"]["tokens_per_s"]
        out.append(f"\nrecipe / Trainer tokens/s at {both} tokens: {rc / tr:.3f} with release_memory, "
                   f"{off / tr:.3f} without")
    if long_timing:
        out.append(markdown_table(["loop", f"tokens/s at {args['long_timing_length']} tokens", "peak RSS (GB)"],
                                  [[v, f"{t['tokens_per_s']:.1f}", f"{t['peak_gb']:.2f}"]
                                   for v, t in long_timing.items()]))
    return "\n".join(out)


if __name__ == "__main__":
    main()
