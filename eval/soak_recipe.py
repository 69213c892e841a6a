"""Soak test of the recipes' promise that a run killed at any moment resumes to the same result: a tiny pretrain
(2-layer Llama, 8 steps, a checkpoint every 2 steps, dropout on) is SIGKILLed again and again, each time resumed
with resume=true, until it finishes; its loss curve (every logged number) and its final model must equal those of
a run that was never killed, and every resume must start from the newest complete checkpoint that was on disk.

    python -m eval.soak_recipe --kills 50                       # about 7 minutes on 2 CPU cores
    python -m eval.soak_recipe --kills 10 --seed 3 --json eval/results/soak_recipe.json

Where the kills land: half are "event" kills, at a file operation under output_dir picked uniformly among those
an uninterrupted run makes (eval.faults: a torn weights/optimizer/RNG/marker/log/config write, or just
before a rename or a removal), so they hit the short windows of save_state and of the final save that a timer
would rarely hit; the other half are "time" kills, SIGKILL from outside after a uniform random delay within the
duration of one uninterrupted launch (mostly start-up and training). A run gets 1 to 4 kills before it is left to
finish.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import hfpatch
from eval import faults
from hfpatch.lm.text import default_corpus
from hfpatch.train import checkpoint

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "pretrain.py"
ARGS = ["model_config={model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
        "num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 128, attention_dropout: 0.1}",
        "seq_len=128", "batch_size=2", "max_steps=8", "eval_every=4", "save_every=2", "lr=3e-3", "warmup_steps=2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # a time kill keeps what was printed
TIMEOUT = 300


def prepare(work: Path) -> list[str]:
    """Training text (Python standard library sources) and a 384-piece tokenizer trained on it."""
    text = work / "text.txt"
    chunks, size = [], 0
    for doc in default_corpus():
        chunks.append(doc.text)
        size += len(doc.text)
        if size >= 300_000:
            break
    text.write_text("".join(chunks)[:300_000])
    subprocess.run([sys.executable, str(REPO / "recipes" / "train_tokenizer.py"), "--text-files", str(text),
                    "--vocab-size", "384", "--out", str(work / "tok")], check=True, capture_output=True, env=ENV)
    return [*ARGS, f"tokenizer={work / 'tok'}", f"data.text_files=[{text}]"]


def curve(out: Path) -> list:
    return [json.loads(line) | {"seconds": None} for line in (out / "log.jsonl").read_text().splitlines()]


def final_logits(out: Path) -> torch.Tensor:
    with torch.no_grad():
        return hfpatch.from_pretrained(out / "final")(torch.arange(3, 60)[None]).logits


def where(out: Path, trace: Path, event_kill: bool) -> tuple[str, str]:
    """(category, detail) of the moment the run died. An event kill dies at the last traced event; a time kill
    after it (or during a save, when a .partial folder is left)."""
    lines = trace.read_text().splitlines() if trace.exists() else []
    last = json.loads(lines[-1]) if lines else None
    if last is None:
        return "start-up", "before any file event"
    kind, path = last["kind"], last["path"]
    detail = f"{'at' if event_kill else 'after'} {kind} {path}"
    if not event_kill:
        saving = [*out.glob("*.partial"), *(out / "checkpoints").glob("*.partial")]
        if (kind, path) == ("rename", "final.partial"):
            return "after the final save (exiting)", detail
        return ("inside a save (timer)" if saving else "training (timer)"), detail
    if path.startswith("final.partial"):
        return "final save", detail
    if re.fullmatch(r"checkpoints/step_\d+\.partial", path):
        return ("checkpoint rename" if kind == "rename" else "checkpoint: clearing a stale folder"), detail
    if path.startswith("checkpoints/"):
        return "inside save_state", detail
    if path.startswith("log.jsonl"):
        return "log write", detail
    return "other", detail


def launch(args, out: Path, kill: str, rng: random.Random, events: int, seconds: float, trace: Path):
    """One launch; returns (return code, stdout, what the kill was)."""
    extra = [f"output_dir={out}"] + (["resume=true"] if out.exists() else [])
    if kill == "event":
        at = rng.randrange(events)
        cmd = faults.command(RECIPE, [*args, *extra], out, kill_at=at, trace=trace)
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=ENV, timeout=TIMEOUT)
        return proc.returncode, proc.stdout, f"event #{at}"
    delay = rng.uniform(0, seconds)
    proc = subprocess.Popen(faults.command(RECIPE, [*args, *extra], out, trace=trace), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=REPO, env=ENV)
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
    stdout = proc.communicate(timeout=TIMEOUT)[0]
    return proc.returncode, stdout, f"after {delay:.2f} s"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=50, help="total SIGKILLs to deliver")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the summary here")
    p.add_argument("--work", help="folder for the runs (default: a temporary one)")
    a = p.parse_args(argv)
    rng = random.Random(a.seed)
    work = Path(a.work or tempfile.mkdtemp(prefix="soak_recipe_"))
    work.mkdir(parents=True, exist_ok=True)
    args = prepare(work)

    trace = work / "reference.trace"
    t0 = time.perf_counter()
    subprocess.run(faults.command(RECIPE, [*args, f"output_dir={work / 'reference'}"], work / "reference",
                                  trace=trace), check=True, capture_output=True, cwd=REPO, env=ENV, timeout=TIMEOUT)
    seconds = time.perf_counter() - t0
    events = len(trace.read_text().splitlines())
    ref_curve, ref_logits = curve(work / "reference"), final_logits(work / "reference")
    print(f"reference run: {seconds:.1f} s, {events} file events under output_dir", flush=True)

    kills, landed, runs, failures, identical = 0, collections.Counter(), [], [], 0
    while kills < a.kills:
        out, budget = work / f"run_{len(runs)}", rng.randint(1, 4)
        run = {"kills": [], "resumes": 0}
        while True:
            expected = checkpoint.newest_complete(out / "checkpoints")[0] if out.exists() else None
            resuming = out.exists()
            kill = rng.choice(["event", "time"]) if len(run["kills"]) < min(budget, a.kills - kills) else None
            t = work / f"run_{len(runs)}.{len(run['kills'])}.trace"
            if kill is None:
                proc = subprocess.run(faults.command(RECIPE, [*args, f"output_dir={out}", "resume=true"], out),
                                      capture_output=True, text=True, cwd=REPO, env=ENV, timeout=TIMEOUT)
                code, stdout, how = proc.returncode, proc.stdout, "none"
            else:
                code, stdout, how = launch(args, out, kill, rng, events, seconds, t)
            said = re.search(r"resumed from .* at step (\d+)", stdout)
            step = int(said.group(1)) if said else (0 if "starting from step 0" in stdout else None)
            if resuming and step is not None:  # (a launch killed during start-up never got to resume)
                run["resumes"] += 1
                want = int(expected.name.split("_")[1]) if expected else 0
                if step != want:
                    failures.append(f"{out.name}: resumed at step {step}, the newest complete checkpoint was {want}")
            elif resuming and code == 0:
                failures.append(f"{out.name}: finished without saying where it resumed from")
            if code == -signal.SIGKILL:
                kills += 1
                category, detail = where(out, t, kill == "event")
                landed[category] += 1
                run["kills"].append(f"{kill} kill {how}: {category}, {detail}")
                continue
            if code != 0:
                failures.append(f"{out.name}: exit code {code}")
                break
            if curve(out) == ref_curve and torch.equal(final_logits(out), ref_logits):
                identical += 1
            else:
                failures.append(f"{out.name}: the loss curve or the final model differs from the reference")
            break
        runs.append(run)
        print(f"run {len(runs)}: {len(run['kills'])} kills, {run['resumes']} resumes | " + " | ".join(run["kills"]),
              flush=True)

    summary = {"kills": kills, "runs": len(runs), "resumes": sum(r["resumes"] for r in runs),
               "identical_runs": identical, "failures": failures,
               "kills_landed": dict(landed.most_common()), "reference_seconds": round(seconds, 1),
               "file_events_per_run": events, "seed": a.seed, "runs_detail": runs}
    print(json.dumps({k: v for k, v in summary.items() if k != "runs_detail"}, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
