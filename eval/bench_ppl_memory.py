"""Chunked scoring (hfpatch eval ppl) vs plain `model(input_ids, labels=input_ids)`: loss, peak memory, time.

Peak memory is a process's maximum RSS, so every measurement runs in a fresh subprocess of this script (the
variants alternate: plain, chunked, chunked, plain, ...). Each worker loads the model, reads the tokens, then runs
the forward + loss once and reports: the loss, the seconds of forward + loss, the process's max RSS (ru_maxrss,
loading included: the number a user sees), and the peak RSS of the forward + loss alone (VmHWM after resetting it
through /proc/self/clear_refs once the model is loaded; Linux only).

    python -m eval.bench_ppl_memory                                      # SmolLM2-135M, 16k tokens, stdlib text
    python -m eval.bench_ppl_memory --text-file ../shared/data/books/moby_dick.txt --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from eval.benchutil import REPO, interleaved, markdown_table, median, module_name, status_kb, worker_command
from hfpatch.lm import budget
from hfpatch.lm import text as data
from hfpatch.lm.causal import causal_lm_parts, window_nll
from hfpatch.lm.tokenizer import load_tokenizer
from hfpatch.models import load
from hfpatch.utils.files import write_json

MODULE = module_name(__file__)  # what the workers run as


def worker(args) -> dict:
    tok = load_tokenizer(args.model)
    doc = data.text_files([args.text_file])[0] if args.text_file else data.default_corpus()[0]
    ids = torch.as_tensor(data.tokenize(tok, doc).ids[: args.length])
    if len(ids) < args.length:
        raise SystemExit(f"{doc.name} has only {len(ids)} tokens")
    model, _ = load(args.model, tokenizer=False)
    model.eval()
    rss_loaded = status_kb("VmRSS")
    reset = False
    try:  # "5" resets the peak RSS (VmHWM) to the current RSS: what follows is the forward's own peak
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        pass
    t0 = time.perf_counter()
    with torch.no_grad():
        if args.worker == "plain":
            loss = model(ids[None], labels=ids[None]).loss.item()
        else:
            nll, n = window_nll(causal_lm_parts(model), ids, 1, args.score_chunk)
            loss = nll / n
    seconds = time.perf_counter() - t0
    return {"variant": args.worker, "loss": loss, "seconds": seconds, "document": doc.name,
            "max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "rss_after_load_gb": rss_loaded / 2**20 if rss_loaded else None,
            "forward_peak_gb": status_kb("VmHWM") / 2**20 if reset else None, "threads": torch.get_num_threads()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--text-file", dest="text_file", help="default: the first document of the default corpus")
    p.add_argument("--score-chunk", type=int, default=1024, dest="score_chunk")
    p.add_argument("--repeats", type=int, default=1, help="fresh processes per variant (alternating)")
    p.add_argument("--json", help="also write the numbers to this file")
    p.add_argument("--worker", choices=["plain", "chunked"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return None

    runs: dict[str, list[dict]] = {"plain": [], "chunked": []}

    def launch(variant):
        # the worker runs from the repository root: paths given relative to here are passed whole
        model = os.path.abspath(args.model) if os.path.exists(args.model) else args.model
        cmd = worker_command(MODULE, ["--worker", variant, "--model", model, "--length", str(args.length),
                                      "--score-chunk", str(args.score_chunk)])
        if args.text_file:
            cmd += ["--text-file", os.path.abspath(args.text_file)]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if r.returncode != 0:
            raise SystemExit(f"{variant} worker failed:\n{r.stderr[-3000:]}")
        runs[variant].append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(f"{variant}: {runs[variant][-1]}", file=sys.stderr, flush=True)

    interleaved({v: (lambda v=v: launch(v)) for v in runs}, args.repeats, warmup=0)
    med = {v: {k: median([r[k] for r in rs]) for k in ("loss", "seconds", "max_rss_gb")} for v, rs in runs.items()}
    for v, rs in runs.items():
        peaks = [r["forward_peak_gb"] for r in rs if r["forward_peak_gb"] is not None]
        med[v]["forward_peak_gb"] = median(peaks) if peaks else None
        med[v]["rss_after_load_gb"] = median([r["rss_after_load_gb"] for r in rs])
    pl, ch = med["plain"], med["chunked"]
    rel = abs(ch["loss"] - pl["loss"]) / abs(pl["loss"])
    ratios = {"loss_rel_diff": rel, "max_rss_ratio": ch["max_rss_gb"] / pl["max_rss_gb"],
              "time_ratio": ch["seconds"] / pl["seconds"]}
    if pl["forward_peak_gb"] and ch["forward_peak_gb"]:
        ratios["forward_peak_ratio"] = ch["forward_peak_gb"] / pl["forward_peak_gb"]

    def fmt(x, spec):
        return "—" if x is None else format(x, spec)

    print(markdown_table(
        ["variant", "tokens", "loss", "forward + loss (s)", "process max RSS (GB)", "forward peak RSS (GB)"],
        [[v, args.length, f"{m['loss']:.6f}", f"{m['seconds']:.1f}", f"{m['max_rss_gb']:.2f}",
          fmt(m["forward_peak_gb"], ".2f")] for v, m in med.items()]
        + [["chunked / plain", "", f"rel. diff {rel:.1e}", f"{ratios['time_ratio']:.3f}",
            f"{ratios['max_rss_ratio']:.3f}", fmt(ratios.get("forward_peak_ratio"), ".3f")]],
    ))
    # what `hfpatch eval ppl` estimates before loading the model (its memory check), next to what was measured
    estimate = budget.memory_needed(budget.shape_of(args.model), 4, args.length, score_chunk=args.score_chunk)
    print(f"eval ppl's estimate before loading: {budget.gb(estimate['total'])} in all "
          f"({', '.join(f'{k} {budget.gb(v)}' for k, v in estimate.items() if k != 'total')}); measured chunked: "
          f"process max RSS {ch['max_rss_gb']:.2f} GB ({ch['rss_after_load_gb']:.2f} GB once loaded)")
    result = {"model": args.model, "length": args.length, "score_chunk": args.score_chunk, "repeats": args.repeats,
              "memory_estimate": estimate,
              "document": runs["plain"][0]["document"], "median": med, "ratios": ratios, "runs": runs}
    if args.json:
        write_json(Path(args.json), result)
    return result


if __name__ == "__main__":
    main()
