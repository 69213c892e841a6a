"""A found patch served as found: saved, reloaded (with hfpatch, and in plain transformers), exported to GGUF, and its
perplexity in llama.cpp against transformers, next to the unpatched model's own gap between the two engines.

    python -m eval.search_served --search eval/results/search/dracula_16k --text-files BOOKS/moby_dick.txt \\
        --out eval/results/search/served.json

For the search's best patch and, where that one has no GGUF form, the best feasible candidate of the search that has
one (its patch exports to llama.cpp's metadata): the patch applied in memory to SmolLM2 (fp32), saved with
hfpatch.save_pretrained; the largest logit difference (8,192 random tokens) against the patched model in memory of
the folder reloaded by hfpatch.from_pretrained and by plain transformers (AutoModelForCausalLM.from_pretrained, with
what it warned or logged); the GGUF export from the embedded Q4_1 file (or hfpatch's refusal); perplexity of the
book's first 8,192 tokens in transformers (the GGUF dequantized to fp32) and in llama.cpp (llama-cpp-python, the
quantized weights), patched and unpatched. Written to --out after every step; the same command skips what it
finished.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import hfpatch
from hfpatch.evaluate.api import run
from hfpatch.interop import gguf as hg
from hfpatch.models import gguf_path, load
from hfpatch.search import objective, report
from hfpatch.utils.files import write_text

LENGTH = 8192


def chosen(search: Path) -> dict[str, dict]:
    """{role: ranked cell}: the search's best, and the best feasible candidate whose patch exports to GGUF."""
    data = json.loads((search / "results.json").read_text())
    cells = [c for c in report.ranked_cells(data) if c.get("complete") and c["family"] != "none"]
    base = next(c["short_ppl"] for c in data["cells"] if c["patch"] == report.REFERENCE)
    guard, window = data["identity"]["guard"], data["identity"]["window"]

    def score(c: dict) -> float:
        full = report.full_cell(data, c["patch"])
        return full["score"] if full else float("inf")

    out = {}
    if data.get("best"):
        out["found"] = next(c for c in cells if c["patch"] == data["best"])
    exportable = [c for c in cells if objective.feasible(c, base, guard) and exports(c["spec"], window)]
    if exportable and ("found" not in out or not exports(out["found"]["spec"], window)):
        out["best exportable"] = min(exportable, key=lambda c: (score(c), c["score"], c["order"]))
    return out


def exports(spec: dict, window: int) -> bool:
    """Whether the patch has a GGUF form, for a model trained to `window` tokens."""
    try:
        hg.request(**spec, trained_window=lambda: window)
    except ValueError:
        return False
    return True


@torch.no_grad()
def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits.float()


def reloads(spec: dict, ids: torch.Tensor, folder: Path) -> dict:
    """Save the patched model; the logit differences of its reloads against it, and what plain transformers said."""
    model, _ = load("smollm2", dtype=torch.float32, tokenizer=False)
    hfpatch.patch(model.eval(), **spec)
    want = logits(model, ids)
    hfpatch.save_pretrained(model, folder)
    again = hfpatch.from_pretrained(folder).eval()
    logged = Logged()
    transformers_log = logging.getLogger("transformers")
    transformers_log.addHandler(logged)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    finally:
        transformers_log.removeHandler(logged)
    said = [str(w.message) for w in seen] + logged.messages
    return {"hfpatch_reload_max_diff": float((logits(again, ids) - want).abs().max()),
            "plain_reload_max_diff": float((logits(plain, ids) - want).abs().max()),
            "plain_reload_warnings": [" ".join(m.split())[:300] for m in said]}


class Logged(logging.Handler):
    """What transformers' logger said at WARNING or above (it logs, rather than warns, about a config it reads)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def exported(spec: dict, out: Path) -> dict:
    try:
        written = hg.export(gguf_path("smollm2"), out, overwrite=True, **spec)
    except ValueError as e:
        return {"gguf": None, "gguf_refusal": " ".join(str(e).split())}
    return {"gguf": str(out.name), "gguf_metadata": {k: v for k, v in written["metadata"].items() if "rope" in k}}


def ppl_pair(spec_text: str, book: str, gguf: str | None) -> dict:
    """Mean NLL per token of the book's first LENGTH tokens in each engine: transformers (the GGUF dequantized) with
    the patch applied and without, llama.cpp on the embedded GGUF as it is and on the exported one as it is."""
    settings = {"lengths": [LENGTH], "text_files": [book], "tokens_per_doc": LENGTH, "no_plot": True}
    tf = run("ppl", "smollm2", patches=["none", spec_text], **settings)
    out = {"transformers": {("none" if c["patch"] == "none" else "patched"): c["mean_nll"] for c in tf["cells"]}}
    if gguf is not None:
        served = {"none": gguf_path("smollm2"), "patched": gguf}
        out["llama.cpp"] = {role: run("ppl", path, engine="llama.cpp", patches=["none"], **settings)["cells"][0]
                            ["mean_nll"] for role, path in served.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--search", required=True, help="the search's --out folder")
    p.add_argument("--text-files", required=True, help="the book the perplexity is measured on")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {"search": args.search, "book": args.text_files,
                                                             "length": LENGTH, "arms": {}}
    from eval.search_study import spec_string

    # as long as the perplexity's text: a patch that only acts far away (an attention path past its chunk) shows there
    ids = torch.randint(100, 40000, (1, LENGTH), generator=torch.Generator().manual_seed(0))
    for role, cell in chosen(Path(args.search)).items():
        arm = data["arms"].setdefault(role, {"candidate": cell["patch"], "label": report.label(cell),
                                             "spec": cell["spec"]})
        with tempfile.TemporaryDirectory() as tmp:
            if "plain_reload_max_diff" not in arm:
                arm.update(reloads(cell["spec"], ids, Path(tmp) / "saved"))
                write_text(out, json.dumps(data, indent=1) + "\n")
            gguf = Path(tmp) / "found.gguf"
            arm.update(exported(cell["spec"], gguf))
            if "nll" not in arm:
                arm["nll"] = ppl_pair(spec_string(cell["spec"]), args.text_files,
                                      str(gguf) if arm["gguf"] else None)
            write_text(out, json.dumps(data, indent=1) + "\n")
        print(f"{role}: {json.dumps(arm)[:400]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
