"""What each step of a search candidate costs, measured side by side in one run: a full-length sample in fp32 and in
bf16, a proxy sample, and the guard's read, for SmolLM2-135M on the search's own samples (run it alone).

    python -m eval.bench_search --text-files ../shared/data/books/dracula.txt \\
        --json eval/results/benchmarks/search_steps.json

Each is the wall time of `objective.score_sample` (or `score_guard`) on the unpatched model after one untimed run,
the median of --repeats runs alternating between them (utils/timing.interleaved).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

import torch

from hfpatch.lm import text as texts
from hfpatch.lm.causal import causal_lm_parts
from hfpatch.lm.tokenizer import load_tokenizer
from hfpatch.models import load
from hfpatch.search import objective
from hfpatch.utils.files import write_json
from hfpatch.utils.timing import interleaved

WINDOW, TARGET, SPAN = 8192, 16384, 32


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text-files", nargs="+", required=True)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--proxy", default="4096x8", help="proxy design TOKENSxSEGMENTS")
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    tok = load_tokenizer("smollm2")
    text = objective.calibration_ids(tok, texts.text_files(args.text_files))
    full = objective.build(tok, text, TARGET, WINDOW, 1, SPAN, 0)
    tokens, segments = (int(x) for x in args.proxy.split("x"))
    proxy = objective.build_proxy(tok, full, tokens, segments, SPAN)[0]
    guard = objective.guard_ids(tok, text, WINDOW)
    models = {dtype: load("smollm2", dtype=dtype, tokenizer=False)[0].eval() for dtype in (torch.float32,
                                                                                         torch.bfloat16)}
    parts = {dtype: causal_lm_parts(m) for dtype, m in models.items()}
    bf16 = parts[torch.bfloat16]
    steps = {
        "full-length sample, fp32": lambda: objective.score_sample(parts[torch.float32], full[0]),
        "full-length sample, bf16": lambda: objective.score_sample(bf16, full[0]),
        "proxy sample, bf16": lambda: objective.score_sample(bf16, proxy),
        "guard read, bf16": lambda: objective.score_guard(bf16, guard),
    }
    with torch.no_grad():
        times = interleaved(steps, args.repeats)
    out = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                       "threads": torch.get_num_threads(), "torch": torch.__version__},
           "target": TARGET, "proxy_tokens": len(proxy.ids), "proxy_design": args.proxy, "repeats": args.repeats,
           "seconds": {name: statistics.median(ts) for name, ts in times.items()}, "runs": times}
    write_json(Path(args.json), out)
    print(json.dumps(out["seconds"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
