"""Throughput and peak memory of the recipes' training loop vs a plain transformers.Trainer: the same model (a
small Llama from scratch), the same packed data, batch, sequence length, optimizer (AdamW), schedule (warm-up +
cosine), clipping and precision (fp32). Each runs in its own fresh process; steps after the first two are timed.

    python -m eval.bench_recipe                          # 4 layers, d=256, SmolLM2's tokenizer, 512 tokens x 4
    python -m eval.bench_recipe --steps 30 --seq-len 1024 --batch 2
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from eval.benchutil import int_options, module_name, passed_on, peak_rss, reset_peak_rss, rss, run_worker
from hfpatch.evaluate.report import markdown_table
from hfpatch.train import data, setup
from hfpatch.train.config import load
from hfpatch.utils.files import write_json

GB = 1024**3
WARM = 2  # steps left out of the timing
MODULE = module_name(__file__)  # what the workers run as


def _setup(args):
    tok = setup.tokenizer(args.tokenizer)
    overrides = [f"seq_len={args.seq_len}", f"batch_size={args.batch}", f"max_steps={args.steps}", "warmup_steps=2",
                 "lr=1e-3", f"data.max_tokens={args.seq_len * args.batch * (args.steps + 4) * 2}",
                 "data.eval_fraction=0.0", f"eval_every={10 * args.steps}", f"save_every={10 * args.steps}",
                 f"output_dir={args.out}", f"tokenizer={args.tokenizer}"]
    if args.text_files:
        overrides.append(f"data.text_files=[{args.text_files}]")
    cfg = load("pretrain", None, [*overrides, "model_config={model_type: llama}"])
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", hidden_size=args.hidden, intermediate_size=int(2.6875 * args.hidden),
                                  num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                                  num_key_value_heads=args.hidden // 64, vocab_size=len(tok),
                                  max_position_embeddings=args.seq_len, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config)
    train_seqs, _ = data.packed(cfg, tok)
    return cfg, model, tok, train_seqs


def recipe_worker(args):
    # each loop's code only in its own worker: a process's peak memory is its loop's, not the other one's imports
    from hfpatch.train import loop

    cfg, model, tok, train_seqs = _setup(args)
    base = rss()
    reset_peak_rss()
    loop.train(cfg, model, tok, train_seqs, torch.zeros(0, args.seq_len, dtype=torch.long))
    rows = [json.loads(line) for line in Path(args.out, "log.jsonl").read_text().splitlines()]
    seconds = rows[-1]["seconds"] - rows[WARM - 1]["seconds"]
    return {"seconds": seconds, "tokens": (args.steps - WARM) * args.batch * args.seq_len, "peak": peak_rss(),
            "base": base, "final_loss": rows[-1]["loss"]}


def trainer_worker(args):
    # each loop's code only in its own worker: a process's peak memory is its loop's, not the other one's imports
    from transformers import Trainer, TrainerCallback, TrainingArguments

    _, model, _, train_seqs = _setup(args)

    class Packed(torch.utils.data.Dataset):
        def __len__(self):
            return len(train_seqs)

        def __getitem__(self, i):
            return {"input_ids": train_seqs[i], "labels": train_seqs[i]}

    marks = {}

    class Clock(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            if state.global_step == WARM:
                marks["start"] = time.perf_counter()
            marks["end"] = time.perf_counter()

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                marks["loss"] = logs["loss"]

    targs = TrainingArguments(output_dir=args.out, per_device_train_batch_size=args.batch, max_steps=args.steps,
                              learning_rate=1e-3, warmup_steps=2, lr_scheduler_type="cosine", weight_decay=0.0,
                              max_grad_norm=1.0, optim="adamw_torch", logging_steps=1, save_strategy="no",
                              report_to=[], use_cpu=True, dataloader_num_workers=0, seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=targs, train_dataset=Packed(), callbacks=[Clock()])
    base = rss()
    reset_peak_rss()
    trainer.train()
    return {"seconds": marks["end"] - marks["start"], "tokens": (args.steps - WARM) * args.batch * args.seq_len,
            "peak": peak_rss(), "base": base, "final_loss": marks.get("loss")}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sizes = int_options(p, layers=4, hidden=256, seq_len=512, batch=4, steps=20)
    p.add_argument("--tokenizer", default="smollm2")
    p.add_argument("--text-files", help="default: the stdlib corpus")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--json")
    p.add_argument("--worker", choices=["recipe", "trainer"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps((recipe_worker if args.worker == "recipe" else trainer_worker)(args)))
        return

    shape = [*passed_on(args, sizes), "--tokenizer", args.tokenizer]
    if args.text_files:  # the workers run from the repository root: each path whole
        shape += ["--text-files", ",".join(os.path.abspath(f) for f in args.text_files.split(","))]
    runs = {"recipe": [], "trainer": []}
    for r in range(args.rounds):
        for variant in ("recipe", "trainer") if r % 2 == 0 else ("trainer", "recipe"):
            with tempfile.TemporaryDirectory() as out:
                runs[variant].append(run_worker(MODULE, ["--worker", variant, "--out", out, *shape]))
    tps = {v: max(r["tokens"] / r["seconds"] for r in rs) for v, rs in runs.items()}
    peak = {v: max(r["peak"] for r in rs) for v, rs in runs.items()}
    print(f"Llama {args.layers} layers, d={args.hidden}, vocab of {args.tokenizer}; batch {args.batch} x "
          f"{args.seq_len} tokens, {args.steps} steps (first {WARM} untimed), fp32, 1 process")
    print(markdown_table(["loop", "tokens/s", "peak RSS (GB)", "final loss"],
                         [[v, f"{tps[v]:.0f}", f"{peak[v] / GB:.2f}", f"{runs[v][0]['final_loss']:.4f}"] for v in tps]))
    print(f"\nratio recipe / Trainer: throughput {tps['recipe'] / tps['trainer']:.3f}, "
          f"peak memory {peak['recipe'] / peak['trainer']:.3f}")
    if args.json:
        write_json(Path(args.json), {"args": vars(args), "runs": runs})


if __name__ == "__main__":
    main()
