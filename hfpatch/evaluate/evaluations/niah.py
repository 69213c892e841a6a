"""Needle in a haystack: one or several needles in real text, a depth x length heatmap of retrieval (the familiar
picture of Kamradt's test and its multi-needle variant).

    hfpatch eval niah [--lengths 1k,2k,4k,8k] [--depths 0,0.25,0.5,0.75,1] [--needles sandwich|pizza|FILE.json]
                      [--trials 1] [--text-files F ...] [--patches none,yarn:2] [--out runs/niah]

The haystack is real text (the default corpus or --text-files), a stretch starting at a random word (one per trial,
from --seed). The needle goes at `depth` of the haystack's length, moved back to the end of a sentence (0 = before
everything, 1 = after everything), as in Kamradt's test; with several
needles (pizza), the first goes at `depth` and the others evenly spaced after it, as in LangChain's multi-needle
test. After the haystack: the question, and the needle set's answer prefix, which the model continues greedily. As
in RULER, the prompt plus the tokens to generate fit in the length. Retrieval is checked by string match: the
score of a trial is the share of the set's answers found in the answer (case-insensitive); decoding stops once all
are found.

Needle sets: `sandwich` (Kamradt's San Francisco needle; answers "sandwich" and "Dolores Park"), `pizza`
(LangChain's three secret ingredients), or a JSON file {"needles": [...], "question": "...", "answer_prefix": "...",
"answers": [...]}.

Writes OUT/results.json after every trial (resumable), OUT/table.md (also printed) and OUT/niah.png.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any, ClassVar

from ...lm import text as texts
from .. import definition, plots, report
from .. import haystack as hs
from ..parsing import length_label, parse_fractions, parse_lengths

NEEDLE_SETS = {
    "sandwich": {
        "needles": ["The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."],
        "question": "What is the best thing to do in San Francisco?",
        "answer_prefix": "The best thing to do in San Francisco is",
        "answers": ["sandwich", "Dolores Park"],
    },
    "pizza": {
        "needles": ["Figs are one of the secret ingredients needed to build the perfect pizza.",
                    "Prosciutto is one of the secret ingredients needed to build the perfect pizza.",
                    "Goat cheese is one of the secret ingredients needed to build the perfect pizza."],
        "question": "What are the secret ingredients needed to build the perfect pizza?",
        "answer_prefix": "The secret ingredients needed to build the perfect pizza are",
        "answers": ["figs", "prosciutto", "goat cheese"],
    },
}
TEMPLATE = "{context}\n\nAnswer the question from the text above. Question: {question}"


def needle_set(name: str) -> dict:
    if name in NEEDLE_SETS:
        return NEEDLE_SETS[name]
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"--needles {name!r}: not a built-in set ({', '.join(NEEDLE_SETS)}) nor a JSON file")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--needles {name}: not valid JSON ({e})") from None
    want = {"needles": list, "question": str, "answer_prefix": str, "answers": list}
    bad = [k for k, t in want.items() if not isinstance(data.get(k) if isinstance(data, dict) else None, t)]
    if bad or not data["needles"] or not data["answers"]:
        raise ValueError(f"--needles {name}: needs needles (a non-empty list), question, answer_prefix and answers "
                         f"(a non-empty list); wrong or missing: {', '.join(bad) or 'an empty list'}")
    for key in ("needles", "answers"):  # answers are matched as text in the model's answer
        if not all(isinstance(v, str) and v.strip() for v in data[key]):
            raise ValueError(f"--needles {name}: {key} must be a list of non-empty strings, got {data[key]!r}")
    return {k: data[k] for k in want}


def depths_of(depth: float, count: int) -> list[float]:
    """Where each needle goes: the first at `depth`, the others evenly spaced between it and the end."""
    return [depth + i * (1 - depth) / count for i in range(count)]


def build(src: hs.Source, offset: int, n_words: int, needles: dict, depth: float) -> hs.Sample:
    """The haystack: n_words words of the text from word `offset` on (wrapping), needles between sentences."""
    words = src.words
    chunk = [words[(offset + i) % len(words)] for i in range(n_words)]
    units = hs.sentences(" ".join(chunk))
    fractions = depths_of(depth, len(needles["needles"]))
    positions = [hs.boundary(units, f) for f in fractions]
    context = " ".join(hs.insert_at(units, needles["needles"], positions))
    return hs.Sample(TEMPLATE.format(context=context, question=needles["question"]),
                     " " + needles["answer_prefix"], list(needles["answers"]),
                     {"fractions": fractions, "positions": positions, "sentences": len(units)})


def _check_haystack(src: hs.Source, size: int, length: int, text_files: Any) -> None:
    """A haystack is a stretch of the text without repeats: a text shorter than the cell needs would be read
    round and round (or, when empty, leave a prompt far shorter than the cell's length)."""
    if size > len(src.words):
        given = ", ".join(map(str, text_files)) if text_files else "the default corpus"
        raise ValueError(f"the haystack text ({given}) has {len(src.words)} words; the {length_label(length)} cell "
                         f"needs about {size}: give longer text (--text-files) or use shorter --lengths")


def _fit(prompter: hs.Prompter, src: hs.Source, offset: int, needles: dict, depth: float, length: int,
         new_tokens: int, start: int | None) -> tuple[int, hs.Sample]:
    """(haystack words, sample): the largest haystack whose prompt leaves room for the generated tokens."""
    try:
        return hs.fit(lambda m: build(src, offset, m, needles, depth), lambda s: len(prompter.ids(s)),
                      length - new_tokens, 1, 4 * length, start)
    except hs.NoRoom as e:
        raise ValueError(f"length {length} is too short: the template, needles and question take {e.tokens} tokens "
                         f"with the smallest haystack, and {new_tokens} are generated (--new-tokens): use lengths "
                         f"of at least {e.tokens + new_tokens}") from None


def trial_offset(seed: int, trial: int, n_words: int) -> int:
    return random.Random(f"{seed}:niah:{trial}").randrange(n_words)


class Niah(definition.Evaluation):
    records = "trials"
    unit_key = "trial"
    axes: ClassVar[dict[str, str]] = {"lengths": "length", "depths": "depth"}

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--lengths", default="1k,2k,4k,8k",
                       help="prompt + generation lengths, k = 1024 (default 1k,2k,4k,8k)")
        p.add_argument("--depths", default="0,0.25,0.5,0.75,1",
                       help="where the (first) needle goes, 0..1 of the haystack (default 0,0.25,0.5,0.75,1)")
        p.add_argument("--needles", default="sandwich",
                       help=f"needle set: {', '.join(NEEDLE_SETS)} or a JSON file (default sandwich)")
        p.add_argument("--trials", type=int, default=1, help="haystacks (random stretches of text) per cell")
        p.add_argument("--new-tokens", type=int, default=32, dest="new_tokens",
                       help="tokens to generate (default 32)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--text-files", nargs="+", metavar="PATH",
                       help="real text for the haystack (default: the default corpus)")
        p.add_argument("--chat-template", action="store_true", dest="chat_template",
                       help="wrap the question and haystack in the tokenizer's chat template")

    def plan(self, args: argparse.Namespace, tok: Any) -> definition.Plan:
        lengths = parse_lengths(args.lengths)
        depths = parse_fractions(args.depths, "--depths", "0 = the start of the haystack, 1 = its end")
        for flag, value, high in (("--trials", args.trials, definition.MAX_PER_CELL),
                                  ("--new-tokens", args.new_tokens, None)):
            definition.check_count(flag, value, high)
        needles = needle_set(args.needles)
        src = hs.source(args.text_files)
        prompter = hs.Prompter(tok, args.chat_template)
        sizes: dict = {}
        cells = []
        for n in lengths:
            for d in depths:
                units = []
                for t in range(args.trials):  # the same haystacks for every spec and after a resume
                    offset = trial_offset(args.seed, t, len(src.words))
                    size, sample = _fit(prompter, src, offset, needles, d, n, args.new_tokens, sizes.get(n))
                    sizes[n] = size
                    _check_haystack(src, size, n, args.text_files)
                    ids = prompter.ids(sample)
                    units.append(definition.Unit(t, definition.decoding(len(ids), args.new_tokens),
                                            (ids, sample.references, offset, size)))
                cells.append(definition.Cell({"length": n, "depth": d}, units))
        identity = {"model": args.model, "dtype": args.dtype, "seed": args.seed, "needles": needles,
                    "new_tokens": args.new_tokens, "haystack": texts.describe_source(args.text_files),
                    "text_sha256": src.sha256, "chat_template": args.chat_template,
                    "template": TEMPLATE}
        settings = {"lengths": lengths, "depths": depths, "trials": args.trials, "needles": args.needles,
                    "dtype": args.dtype, "device_map": args.device_map}
        return definition.Plan(identity, cells, read=max(lengths), new_tokens=args.new_tokens,
                          info={"settings": settings})

    def run_unit(self, run: Any, cell: dict, unit: Any, progress: Any) -> dict:
        ids, references, offset, size = unit.data
        eos = {i for i in [run.tok.eos_token_id] if i is not None}
        answer = run.tok.decode(run.greedy(ids, run.args.new_tokens, eos, hs.all_found(run.tok, references)),
                                skip_special_tokens=True)
        clean = hs.postprocess(answer)
        return {"prompt_tokens": len(ids), "offset": offset, "haystack_words": size, "answer": answer,
                "found": [r.lower() in clean.lower() for r in references],
                "score": hs.string_match_all(clean, references)}

    def summarize(self, records: list[dict]) -> dict:
        return {"score": sum(r["score"] for r in records) / len(records)}

    def caption(self, data: dict) -> str:
        s = data["settings"]
        name = data.get("model", {}).get("name", data["identity"]["model"])
        return (f"{name}: needle in a haystack ({s['needles']}), {s['trials']} haystack(s) per cell, share of the "
                "answers found")

    def tables(self, data: dict) -> str:
        s = data["settings"]
        return report.grid_tables(data["cells"], s["patches"], s["lengths"], s["depths"], title="needle retrieval",
                                  row="depth", value="score")

    def plot(self, data: dict, path: Path | str, title: str) -> None:
        s = data["settings"]
        plots.grid_heatmap(data["cells"], s["patches"], s["lengths"], s["depths"], path, title=title,
                            row="depth of the needle", value="score")


EVALUATION = Niah()
main = EVALUATION.main
