"""Settle a textbook claim by measuring it: pretrain N small models that differ in one axis only (same data, seed,
tokenizer, steps), evaluate each, and write one JSON, table and plot for the study.

    accelerate launch --config_file recipes/accelerate/cpu.yaml recipes/compare.py \
        --config recipes/configs/compare_positions.yaml [key=value ...]

key=value overrides reach into the study config with dotted keys: `pretrain.max_steps=20`, `seeds=[0,1]`,
`output_dir=runs/x`, `arms={rope: {}, alibi: {patch: {position: alibi}}}`.

Writes, under output_dir: one folder per run (the pretrain run: log.jsonl, checkpoints, final; its evaluations),
and compare_<study>.json / .md / .png. The JSON is rewritten after every run, so it always holds what is done; a
study started again skips finished runs, resumes an interrupted one from its checkpoint, and evaluations resume
from their results files.
"""

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from accelerate.state import PartialState
from accelerate.utils import set_seed
from studies import measure  # recipes/studies/, beside this script
from studies import report as study_report
from studies.study import Run, StudyConfig, claim, load_study, newest_checkpoint, plan

import hfpatch
import hfpatch.introspect
from hfpatch import evaluate as evaluations
from hfpatch.evaluate.common import versions
from hfpatch.models import load
from hfpatch.train import checkpoint, data, init, loop, setup
from hfpatch.train.config import ConfigError
from hfpatch.train.tokenizer import train_tokenizer


def train(run: Run, study: StudyConfig, tok) -> None:
    """The run is recipes/pretrain.py with its overrides, in this process (so the gradients can be recorded)."""
    if (run.out / "final").is_dir():
        return
    # An interrupted run goes on from its newest complete checkpoint, named, so that training and the gradient-norm
    # rows (numbered from `start`) resume from the same step.
    resume_from = newest_checkpoint(run.out)
    cfg = dataclasses.replace(run.cfg, resume=str(resume_from) if resume_from else False)
    start = checkpoint.step_of(resume_from) if resume_from else 0
    set_seed(cfg.seed)  # as pretrain.py: the same initial weights for every arm that has the same shapes
    model = setup.from_config(cfg, tok)
    setup.apply_patch(model, cfg)  # new parameters (t5, xl, learned) are drawn after the model's own
    train_seqs, eval_seqs = data.packed(cfg, tok)
    grads = None
    if study.evaluate.grad_norms:
        run.out.mkdir(parents=True, exist_ok=True)
        grads = measure.GradNorms(model, run.out / "grad_norms.jsonl", start)
    try:
        loop.train(cfg, model, tok, train_seqs, eval_seqs)
    finally:
        if grads:
            grads.close()


def first_step(run: Run, tok, train_seqs) -> dict:
    """The run's model as it started (the same seed, init and patch as train()) and the gradient of each of its
    block's parameters on its first batch: the first step's gradients, parameter by parameter."""
    cfg = run.cfg
    set_seed(cfg.seed)
    model = setup.apply_patch(setup.from_config(cfg, tok), cfg)
    ids = train_seqs[data.batch_indices(len(train_seqs), cfg.batch_size, 0, cfg.seed)]
    return measure.first_step_gradients(model, ids)


def evaluate(run: Run, study: StudyConfig, held_out, tok=None, train_seqs=None) -> dict:
    """Everything the study measures on this run's final model (saved and reloaded, as a user would get it)."""
    ev, cfg, final = study.evaluate, run.cfg, run.out / "final"
    t0 = time.perf_counter()
    model, _ = load(str(final))
    init.restore(model)  # init=paper's embedding scale (its config records it)
    model.eval()
    info = hfpatch.describe(model)
    limit = hfpatch.introspect.table_limit(model)  # a learned table fails past its rows: lengths past it are not run
    out = {"arm": run.arm, "seed": run.seed, "name": run.name, "overrides": run.overrides, "command": run.command,
           "parameters": sum(p.numel() for p in model.parameters()), "applied": info["applied"],
           "training": measure.training_summary(run.out)}
    if ev.text_files:
        lengths = ev.lengths or [cfg.seq_len]
        usable = [n for n in lengths if limit is None or n <= limit]
        out["refused_lengths"] = {str(n): f"past the learned table's {limit} rows" for n in lengths if n not in usable}
        # the evaluation's own results file under the run: a killed study resumes it where it stopped
        cells = evaluations.perplexity(str(final), out=str(run.out / "eval_ppl"), text_files=ev.text_files,
                                       lengths=usable, tokens_per_doc=ev.tokens_per_doc, patches="none",
                                       no_plot=True)["cells"]
        out["ppl"] = {str(c["length"]): c["ppl"] for c in cells if c.get("complete")}
    if ev.batch_statistics:
        out["statistics"] = measure.statistics_effect(model, held_out, cfg.seq_len, cfg.batch_size)
    r = ev.recall
    if r is not None and run.arm in r.get("arms", study.arms):
        out["recall"] = measure.recall(model, held_out, r["distances"], r.get("span", 32), r.get("trials", 16),
                                       limit=limit)
    p = ev.passkey
    if p is not None and run.arm in p.get("arms", study.arms):
        cells = evaluations.passkey(str(final), out=str(run.out / "eval_passkey"), lengths=p["lengths"],
                                    depths=p.get("depths", [0, 0.5, 1]), trials=p.get("trials", 5), patches="none",
                                    no_plot=True)["cells"]
        out["passkey"] = {str(n): sum(c["accuracy"] for c in cells if c["length"] == n) /
                          max(1, sum(1 for c in cells if c["length"] == n)) for n in p["lengths"]}
        out["passkey_answers"] = [t["answer"] for c in cells for t in c["trials"]][:6]
    if ev.grad_norms:
        # per block at the first step (before any update: the gradients at initialisation); the total at every
        # step (the per-block rows of every step stay in the run's grad_norms.jsonl)
        rows = measure.read_jsonl(run.out / "grad_norms.jsonl")
        steps = [{"step": row["step"], "total": sum(v * v for k, v in row.items() if k != "step") ** 0.5}
                 for row in rows]
        out["grad_norms"] = {"init": {k: v for k, v in rows[0].items() if k != "step"} if rows else {},
                             "steps": steps}
        if train_seqs is not None:
            out["grad_norms"]["init_parameters"] = first_step(run, tok, train_seqs)
    out["eval_seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main(study: StudyConfig) -> None:
    if PartialState().num_processes > 1:
        raise ConfigError("compare.py trains its runs one after another in one process; launch it with one process "
                          "(--config_file recipes/accelerate/cpu.yaml)")
    runs = plan(study)  # every arm's config is checked before anything trains
    tok_dir = runs[0].cfg.tokenizer
    if not os.path.exists(tok_dir):  # a small BPE on the training text, as README run (b) (the same script)
        files = runs[0].cfg.data.text_files
        train_tokenizer([files] if isinstance(files, str) else files, study.tokenizer_vocab, tok_dir)
    tok = setup.tokenizer(tok_dir)
    held_out = measure.held_out_tokens(study, tok) if study.evaluate.text_files else None
    summary: dict[str, Any] = {"study": study.study, "config": study.as_dict(), "arms": list(study.arms),
                               "seeds": study.seeds, "lengths": study.evaluate.lengths,
                               "trained_length": runs[0].cfg.seq_len, "runs": [], "versions": versions(),
                               "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                               "argv": sys.argv[1:]}
    # every arm trains on the same packed data unless an arm changes the data or seq_len
    same_data = all(r.cfg.data == runs[0].cfg.data and r.cfg.seq_len == runs[0].cfg.seq_len for r in runs)
    train_seqs = data.packed(runs[0].cfg, tok)[0]
    # what a model that learnt only the token frequencies would reach (the training split of the first arm's data)
    summary["unigram_loss"] = measure.unigram_loss(train_seqs)
    out = Path(study.output_dir)
    for run in runs:
        claim(run)  # a folder trained with other settings is refused, not reused
    for run in runs:
        t0 = time.perf_counter()
        train(run, study, tok)
        summary["runs"].append({**evaluate(run, study, held_out, tok, train_seqs if same_data else None),
                                "wall_seconds": round(time.perf_counter() - t0, 1)})
        study_report.write(summary, out, plot_it=False)
    rounds = study.evaluate.step_time_rounds
    if rounds and held_out is not None:  # the study's check: step_time_rounds comes with held-out text
        # the runs' own s/step come from different moments of a shared machine: this compares them fairly
        first: dict[str, Run] = {}
        for r in runs:
            first.setdefault(r.arm, r)  # one run per arm (its first seed)
        models = {arm: load(str(r.out / "final"))[0] for arm, r in first.items()}
        cfg = runs[0].cfg
        batch = held_out[: cfg.batch_size * cfg.seq_len].view(cfg.batch_size, cfg.seq_len)
        summary["step_time"] = {"seconds": measure.step_times(models, batch, rounds), "rounds": rounds,
                                "batch": f"{cfg.batch_size} x {cfg.seq_len}"}
    path = study_report.write(summary, out)
    print(study_report.table(summary))
    print(f"\n{path} (+ .md, .png)", file=sys.stderr)


def cli(argv=None) -> int:
    p = argparse.ArgumentParser(prog="compare", description=__doc__.splitlines()[0])
    p.add_argument("--config", help="YAML study config (recipes/configs/compare_*.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args(argv)
    try:
        main(load_study(args.config, args.overrides))
    except ConfigError as e:
        print(f"compare: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
