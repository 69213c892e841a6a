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

import itertools
import random
import re
import sys
import time
from pathlib import Path

import torch

from ..cli import Parser
from .common import (Results, add_model_arguments, applied, check_patches, length_label, load_model,
                     load_tokenizer, now, parse_lengths, parse_patches, position_limit, run_main, trained_window,
                     versions)
from .score import _logits, causal_lm_parts

PROG = "hfpatch eval passkey"
TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
        "I will quiz you about the important information there.")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
KEY_LINE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"


def prompt_text(n_filler: int, depth: float, key: str) -> str:
    before = round(depth * n_filler)
    return "\n".join([TASK, " ".join([FILLER] * before), KEY_LINE.format(key=key),
                      " ".join([FILLER] * (n_filler - before)), QUESTION])


def _n_tokens(tok, text: str) -> int:
    return len(tok(text, verbose=False)["input_ids"])


def build_prompt(tok, length: int, depth: float, key: str) -> tuple[list[int], int]:
    """(token ids of the longest prompt with at most `length` tokens, filler repetitions in it)."""
    base = _n_tokens(tok, prompt_text(0, depth, key))
    if base > length:
        raise ValueError(f"length {length} is shorter than the passkey prompt without filler ({base} tokens)")
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


@torch.no_grad()
def greedy(parts, ids: list[int], new_tokens: int, eos: set[int]) -> list[int]:
    """Greedy decoding with a KV cache: one forward over the prompt, then one token at a time. Only the last
    position goes through the LM head (no [L, vocab] logits)."""
    x = torch.tensor([ids], device=parts.input_device)
    out = parts.base(input_ids=x, use_cache=True)
    past, generated = out.past_key_values, []
    h = out.last_hidden_state[:, -1]
    for _ in range(new_tokens):
        nxt = int(_logits(parts, h).argmax(-1)[0])
        generated.append(nxt)
        if nxt in eos or len(generated) == new_tokens:
            break
        out = parts.base(input_ids=torch.tensor([[nxt]], device=parts.input_device), past_key_values=past,
                         use_cache=True)
        past, h = out.past_key_values, out.last_hidden_state[:, -1]
    return generated


def is_correct(answer: str, key: str) -> bool:
    return key in re.findall(r"\d+", answer)


def make_key(seed: int, length: int, depth: float, trial: int, digits: int) -> str:
    rng = random.Random(f"{seed}:{length}:{depth:g}:{trial}")  # str seeds are hashed deterministically
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def parse_depths(text: str) -> list[float]:
    try:
        depths = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--depths must be numbers between 0 and 1, got {text!r}") from None
    if not depths or any(not 0 <= d <= 1 for d in depths):
        raise ValueError(f"--depths must be numbers between 0 and 1 (0 = right after the task line, 1 = right "
                         f"before the question), got {text!r}")
    if len(set(depths)) != len(depths):
        raise ValueError(f"--depths repeats a depth: {text}")
    return sorted(depths)


def build_parser(prog: str = PROG) -> Parser:
    p = Parser(prog=prog, description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--lengths", default="1k,2k,4k,8k", help="prompt lengths in tokens, k = 1024 (default 1k,2k,4k,8k)")
    p.add_argument("--depths", default="0,0.5,1", help="where the key goes, 0..1 of the filler (default 0,0.5,1)")
    p.add_argument("--trials", type=int, default=2, help="random keys per (patch, length, depth) (default 2)")
    p.add_argument("--key-digits", type=int, default=5, dest="key_digits")
    p.add_argument("--new-tokens", type=int, default=12, dest="new_tokens", help="tokens to generate (default 12)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/passkey", help="folder for results.json, table.md, passkey.png")
    p.add_argument("--overwrite", action="store_true", help="discard an existing results file instead of resuming")
    p.add_argument("--no-plot", action="store_true", dest="no_plot")
    return p


def main(argv=None) -> int:
    return run_main(_main, argv, PROG)


def _main(argv) -> int:
    args = build_parser().parse_args(argv)
    lengths, depths, patches = parse_lengths(args.lengths), parse_depths(args.depths), parse_patches(args.patches)
    for name, value, low in (("--trials", args.trials, 1), ("--key-digits", args.key_digits, 1),
                             ("--new-tokens", args.new_tokens, 1)):
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    if args.new_tokens < args.key_digits:
        print(f"{PROG}: --new-tokens {args.new_tokens} may be too few to write a {args.key_digits}-digit key",
              file=sys.stderr)
    tok = load_tokenizer(args.model)
    # Build the shortest prompt now: a length too short for the prompt is an input error, before loading the model.
    build_prompt(tok, min(lengths), 0.0, "9" * args.key_digits)

    identity = {"model": args.model, "dtype": args.dtype, "seed": args.seed, "key_digits": args.key_digits,
                "new_tokens": args.new_tokens, "prompt": [TASK, FILLER, KEY_LINE, QUESTION]}
    out = Path(args.out)
    results = Results(out / "results.json", "passkey", identity, args.overwrite)
    if results.resumed:
        print(f"{PROG}: resuming from {out / 'results.json'}", file=sys.stderr)
    results.data.update(settings={"lengths": lengths, "depths": depths, "trials": args.trials,
                                  "patches": [p for p, _ in patches], "dtype": args.dtype,
                                  "device_map": args.device_map, "argv": list(sys.argv[1:] if argv is None else argv)},
                        versions=versions())
    todo = [(p, kw, n, d) for p, kw in patches for n in lengths for d in depths
            if not _done(results, p, n, d, args.trials)]
    if todo:
        model = load_model(args)
        _prepare(model, patches, lengths, results, args.model)
        _run(model, tok, todo, args, results)
        results.save()
    _report(results, [p for p, _ in patches], lengths, depths, out, not args.no_plot)
    return 0


def _done(results, patch, length, depth, trials) -> bool:
    return any(c["patch"] == patch and c["length"] == length and c["depth"] == depth and c.get("complete")
               and len(c["trials"]) >= trials for c in results.data["cells"])


def _prepare(model, patches, lengths, results, name) -> None:
    from ..apply import unwrap

    causal_lm_parts(model)
    check_patches(model, patches)
    for spec, kwargs in patches:
        with applied(model, kwargs, spec):
            limit = position_limit(model)
        if limit and max(lengths) + 64 > limit:
            raise ValueError(f"patch {spec!r}: the model has learned positions for {limit} tokens only; "
                             f"use lengths <= {limit - 64} (the answer needs room too)")
    target = unwrap(model)
    results.data["model"] = {"name": name, "class": type(target).__name__, "model_type": target.config.model_type,
                             "trained_window": trained_window(model),
                             "dtype": str(next(target.parameters()).dtype).replace("torch.", "")}


def _run(model, tok, todo, args, results) -> None:
    from tqdm.auto import tqdm

    parts = causal_lm_parts(model)
    eos = {i for i in [tok.eos_token_id] if i is not None}

    def started(patch, length, depth) -> int:
        cell = results.find({"patch": patch, "length": length, "depth": depth})
        return len(cell["trials"]) if cell else 0

    total = sum(max(0, args.trials - started(p, n, d)) for p, _, n, d in todo)
    bar = tqdm(total=total, unit="trial", desc="passkey", file=sys.stderr, dynamic_ncols=True)
    try:
        for patch, group in itertools.groupby(todo, key=lambda item: item[0]):
            group = list(group)
            with applied(model, group[0][1], patch):  # patch once per spec, not per cell
                for _, kwargs, length, depth in group:
                    bar.set_postfix_str(f"{patch} {length_label(length)} depth {depth:g}")
                    cell = results.cell({"patch": patch, "length": length, "depth": depth},
                                        lambda: {"patch": patch, "patch_kwargs": kwargs, "length": length,
                                                 "depth": depth, "trials": [], "complete": False})
                    for trial in range(len(cell["trials"]), args.trials):
                        key = make_key(args.seed, length, depth, trial, args.key_digits)
                        ids, n_filler = build_prompt(tok, length, depth, key)
                        t0 = time.perf_counter()
                        answer = tok.decode(greedy(parts, ids, args.new_tokens, eos), skip_special_tokens=True)
                        cell["trials"].append({"key": key, "prompt_tokens": len(ids), "filler": n_filler,
                                               "answer": answer, "correct": is_correct(answer, key),
                                               "seconds": round(time.perf_counter() - t0, 3)})
                        results.save()
                        bar.update(1)
                    cell.update(accuracy=sum(t["correct"] for t in cell["trials"]) / len(cell["trials"]),
                                complete=True, finished=now())
                    results.save()
    finally:
        bar.close()


def _report(results, patches, lengths, depths, out: Path, plot: bool) -> None:
    from . import report

    cells = results.data["cells"]
    name = results.data.get("model", {}).get("name", results.data["identity"]["model"])
    trials = results.data["settings"]["trials"]
    caption = f"{name}: passkey retrieval, {trials} random key(s) per cell, greedy decoding"
    text = f"{caption}\n\n" + report.passkey_tables(cells, patches, lengths, depths)
    (out / "table.md").write_text(text + "\n")
    print(text)
    if plot:
        report.passkey_heatmap(cells, patches, lengths, depths, out / "passkey.png", title=caption)
        print(f"\nheatmap: {out / 'passkey.png'}; results: {out / 'results.json'}", file=sys.stderr)
