"""Passkey retrieval: a number hidden at a depth inside filler text; the model must repeat it.

    hfpatch eval passkey [--model smollm2] [--lengths 1k,2k,4k,8k] [--depths 0,0.5,1] [--trials 2]
                         [--patches none,yarn:2] [--out runs/passkey]

The standard prompt (Mohtashami & Jaggi's landmark-attention test, used by the YaRN and LongLoRA papers): a task
line, the filler "The grass is green. ..." repeated, "The pass key is 68431. Remember it. 68431 is the pass key."
inserted after a fraction `depth` of the filler repetitions, and "What is the pass key? The pass key is". The filler
is repeated as often as fits in `length` tokens. Greedy decoding with a KV cache; a trial is correct when the key
appears as a whole number in the answer. Keys are random (`--key-digits` digits) from an RNG seeded by
(seed, length, depth, trial): every patch spec sees the same keys, and a resumed run the same ones.

Writes OUT/results.json after every trial (a rerun with the same arguments resumes), OUT/table.md (also printed)
and OUT/passkey.png (heatmap of accuracy by length x depth, one panel per patch spec).
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from pathlib import Path
from typing import Any, ClassVar

from .. import definition, plots, report
from ..parsing import parse_fractions, parse_lengths

TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
        "I will quiz you about the important information there.")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
KEY_LINE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
MAX_KEY_DIGITS = 1000  # --key-digits: a key is drawn as a number of that many digits (10**2**63 is never drawn)


def prompt_text(n_filler: int, depth: float, key: str) -> str:
    before = round(depth * n_filler)
    return "\n".join([TASK, " ".join([FILLER] * before), KEY_LINE.format(key=key),
                      " ".join([FILLER] * (n_filler - before)), QUESTION])


def _n_tokens(tok: Any, text: str) -> int:
    return len(tok(text, verbose=False)["input_ids"])


def build_prompt(tok: Any, length: int, depth: float, key: str) -> tuple[list[int], int]:
    """(token ids of the longest prompt with at most `length` tokens, filler repetitions in it)."""
    base = _n_tokens(tok, prompt_text(0, depth, key))
    if base > length:
        raise ValueError(f"length {length} is shorter than the passkey prompt without filler ({base} tokens): use "
                         f"lengths of at least {base}")
    per = max(1, _n_tokens(tok, prompt_text(8, depth, key)) - base) / 8
    n = max(0, int((length - base) / per))
    ids = tok(prompt_text(n, depth, key), verbose=False)["input_ids"]
    while len(ids) > length and n > 0:  # the estimate overshot: drop the excess repetitions (rarely more than one)
        n -= max(1, int((len(ids) - length) / per))
        n = max(n, 0)
        ids = tok(prompt_text(n, depth, key), verbose=False)["input_ids"]
    while True:  # undershot by more than a repetition: add them while they fit
        more = tok(prompt_text(n + 1, depth, key), verbose=False)["input_ids"]
        if len(more) > length:
            break
        n, ids = n + 1, more
    return list(ids), n


def is_correct(answer: str, key: str) -> bool:
    return key in re.findall(r"\d+", answer)


def make_key(seed: int, length: int, depth: float, trial: int, digits: int) -> str:
    rng = random.Random(f"{seed}:{length}:{depth:g}:{trial}")  # str seeds are hashed deterministically
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


class Passkey(definition.Evaluation):
    records = "trials"
    unit_key = "trial"
    axes: ClassVar[dict[str, str]] = {"lengths": "length", "depths": "depth"}

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--lengths", default="1k,2k,4k,8k",
                       help="prompt lengths in tokens, k = 1024 (default 1k,2k,4k,8k)")
        p.add_argument("--depths", default="0,0.5,1", help="where the key goes, 0..1 of the filler (default 0,0.5,1)")
        p.add_argument("--trials", type=int, default=2, help="random keys per (patch, length, depth) (default 2)")
        p.add_argument("--key-digits", type=int, default=5, dest="key_digits")
        p.add_argument("--new-tokens", type=int, default=12, dest="new_tokens",
                       help="tokens to generate (default 12)")
        p.add_argument("--seed", type=int, default=0)

    def plan(self, args: argparse.Namespace, tok: Any) -> definition.Plan:
        lengths = parse_lengths(args.lengths)
        depths = parse_fractions(args.depths, "--depths", "0 = right after the task line, 1 = right before the "
                                 "question")
        for name, value, high in (("--trials", args.trials, definition.MAX_PER_CELL),
                                  ("--key-digits", args.key_digits, MAX_KEY_DIGITS),
                                  ("--new-tokens", args.new_tokens, None)):
            definition.check_count(name, value, high)
        if args.new_tokens < args.key_digits:
            print(f"{self.prog}: --new-tokens {args.new_tokens} may be too few to write a {args.key_digits}-digit "
                  "key", file=sys.stderr)
        cells = []
        for n in lengths:
            for d in depths:
                units = []
                for t in range(args.trials):  # the same keys and prompts for every spec, and after a resume
                    key = make_key(args.seed, n, d, t, args.key_digits)
                    ids, n_filler = build_prompt(tok, n, d, key)
                    units.append(definition.Unit(t, definition.decoding(len(ids), args.new_tokens),
                                                 (key, ids, n_filler)))
                cells.append(definition.Cell({"length": n, "depth": d}, units))
        identity = {"model": args.model, "dtype": args.dtype, "seed": args.seed, "key_digits": args.key_digits,
                    "new_tokens": args.new_tokens, "prompt": [TASK, FILLER, KEY_LINE, QUESTION]}
        settings = {"lengths": lengths, "depths": depths, "trials": args.trials, "dtype": args.dtype,
                    "device_map": args.device_map}
        return definition.Plan(identity, cells, read=max(lengths), new_tokens=args.new_tokens,
                          info={"settings": settings})

    def run_unit(self, run: Any, cell: dict, unit: Any, progress: Any) -> dict:
        key, ids, n_filler = unit.data
        eos = {i for i in [run.tok.eos_token_id] if i is not None}
        answer = run.tok.decode(run.greedy(ids, run.args.new_tokens, eos), skip_special_tokens=True)
        return {"key": key, "prompt_tokens": len(ids), "filler": n_filler, "answer": answer,
                "correct": is_correct(answer, key)}

    def summarize(self, records: list[dict]) -> dict:
        return {"accuracy": sum(r["correct"] for r in records) / len(records)}

    def caption(self, data: dict) -> str:
        name = data.get("model", {}).get("name", data["identity"]["model"])
        return f"{name}: passkey retrieval, {data['settings']['trials']} random key(s) per cell, greedy decoding"

    def tables(self, data: dict) -> str:
        s = data["settings"]
        return report.grid_tables(data["cells"], s["patches"], s["lengths"], s["depths"], title="passkey accuracy",
                                  row="depth")

    def plot(self, data: dict, path: Path | str, title: str) -> None:
        s = data["settings"]
        plots.grid_heatmap(data["cells"], s["patches"], s["lengths"], s["depths"], path, title=title,
                            row="depth of the key")


EVALUATION = Passkey()
main = EVALUATION.main
