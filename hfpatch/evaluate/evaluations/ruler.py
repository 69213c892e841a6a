"""The synthetic tasks of RULER (Hsieh et al., 2024), generated offline and deterministically from a seed.

    hfpatch eval ruler [--tasks niah_single_1,vt,...|all] [--lengths 4k,8k,16k] [--samples 20] [--seed 0]
                       [--patches none,yarn:2] [--text-files F ...] [--chat-template] [--out runs/ruler]

Tasks, as RULER defines them (scripts/synthetic.yaml of NVIDIA/RULER):
  niah_single_1    one needle in repeated noise; key a word pair, value a 7-digit number
  niah_single_2    the same in real text
  niah_single_3    real text, the value a UUID
  niah_multikey_1  real text, the needle among 3 needles of other keys
  niah_multikey_2  the haystack is made of needles of other keys (numbers)
  niah_multikey_3  the same with UUID keys and UUID values
  niah_multivalue  real text, 4 values under the same key: all 4 are asked
  niah_multiquery  real text, 4 keys with one value each: all 4 are asked
  vt               variable tracking: a chain VAR A = 12345, VAR B = VAR A, ... (4 hops) in noise; name them all
  cwe              common words: a numbered list where 10 words appear 30 times (6 under 4k) and the others 3
                   times (1 under 4k); name the 10 (one worked example first)
  fwe              frequent words: random 6-letter "coded words" drawn from a Zipf law (alpha 2); name the 3 most
                   frequent ones (the most frequent is "...", which the question says to ignore)
RULER's two QA tasks need SQuAD / HotpotQA downloads and are not included. Real text ("essay" in RULER, Paul Graham
essays there) is the default corpus or --text-files; word keys and the word lists are drawn from that text's words.

Each prompt, with the tokens to generate (niah 128, vt 30, cwe 120, fwe 50), fits in the length, as in RULER: the
haystack is the largest that fits (bisection on its size). The prompt is the task text followed by the task's
answer prefix (RULER's "base" template); --chat-template wraps the task text in the tokenizer's chat template first.
Greedy decoding, stopped once every reference is in the answer (more text could not change its score). Scoring as
RULER's: every task uses string_match_all, the share of the references found
(case-insensitive substring) in the answer, averaged over samples; tables show it in % with a 95 % Wilson interval
over the samples (a binomial interval, conservative for tasks with partial credit).

Writes OUT/results.json after every sample (resumable), OUT/table.md (also printed) and OUT/ruler.png.
"""

from __future__ import annotations

import argparse
import random
import string
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from ...lm import text as texts
from .. import definition, plots, report
from .. import haystack as hs
from ..parsing import length_label, parse_lengths
from ..stats import pooled, wilson

NIAH_TEMPLATE = ("Some special magic {vs} are hidden within the following text. Make sure to memorize it. I will "
                 "quiz you about the {vs} afterwards.\n{context}\nWhat are all the special magic {vs} for {query} "
                 "mentioned in the provided text?")
NIAH_TEMPLATE_ONE = ("A special magic {v} is hidden within the following text. Make sure to memorize it. I will "
                     "quiz you about the {v} afterwards.\n{context}\nWhat is the special magic {v} for {query} "
                     "mentioned in the provided text?")
NIAH_PREFIX = " The special magic {vs} for {query} mentioned in the provided text are"
NIAH_PREFIX_ONE = " The special magic {v} for {query} mentioned in the provided text is"
NEEDLE = "One of the special magic {vs} for {key} is: {value}."
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above.")
VT_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {n} variables are "
             "assigned the value {query}, they are: ")
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
                "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above "
                "list?")
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
                "the dots '....'. What are the three most frequently appeared words in the above coded text?")
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

# RULER's needle-in-a-haystack variants (scripts/synthetic.yaml)
NIAH = {
    "niah_single_1": dict(haystack="noise", keys="words", values="numbers", n_keys=1, n_values=1, n_queries=1),
    "niah_single_2": dict(haystack="essay", keys="words", values="numbers", n_keys=1, n_values=1, n_queries=1),
    "niah_single_3": dict(haystack="essay", keys="words", values="uuids", n_keys=1, n_values=1, n_queries=1),
    "niah_multikey_1": dict(haystack="essay", keys="words", values="numbers", n_keys=4, n_values=1, n_queries=1),
    "niah_multikey_2": dict(haystack="needle", keys="words", values="numbers", n_keys=1, n_values=1, n_queries=1),
    "niah_multikey_3": dict(haystack="needle", keys="uuids", values="uuids", n_keys=1, n_values=1, n_queries=1),
    "niah_multivalue": dict(haystack="essay", keys="words", values="numbers", n_keys=1, n_values=4, n_queries=1),
    "niah_multiquery": dict(haystack="essay", keys="words", values="numbers", n_keys=4, n_values=1, n_queries=4),
}


def niah(rng: random.Random, n: int, src: hs.Source, haystack: str, keys: str, values: str, n_keys: int,
         n_values: int, n_queries: int) -> hs.Sample:
    """RULER's needle-in-a-haystack. n = haystack size: words of real text, noise repetitions, or distractor
    needles."""
    n_keys = max(n_keys, n_queries)
    vs = values
    key_list = hs.distinct(keys, rng, src.pool, n_keys)
    value_list = [hs.distinct(values, rng, src.pool, n_values) for _ in key_list]
    needles = [NEEDLE.format(vs=vs, key=k, value=v) for k, vals in zip(key_list, value_list) for v in vals]
    rng.shuffle(needles)
    if haystack == "essay":
        units = hs.sentences(src.first_words(n))
        fractions = [d / 100 for d in rng.sample(hs.DEPTHS, len(needles))]
        joiner = " "
    else:
        if haystack == "noise":
            units = [hs.NOISE] * n
        else:  # distractor needles: keys and values that are none of the real ones
            d_keys = hs.distinct(keys, rng, src.pool, n, avoid=key_list)
            d_values = hs.distinct(values, rng, src.pool, n, avoid=[v for vals in value_list for v in vals])
            units = [NEEDLE.format(vs=vs, key=k, value=v) for k, v in zip(d_keys, d_values)]
        # needle before unit i: the fraction (i + 0.5) / n (int(n * fraction) == i, with no rounding doubt)
        fractions = ([(i + 0.5) / n for i in sorted(rng.sample(range(n), len(needles)))] if n >= len(needles)
                     else [0.0] * len(needles))
        joiner = "\n"
    context = joiner.join(hs.insert(units, needles, fractions))
    asked = rng.sample(range(n_keys), n_queries)
    queries = [key_list[i] for i in asked]
    references = [v for i in asked for v in value_list[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    if n_queries * n_values == 1:
        v = vs[:-1]  # singular: "A special magic number is hidden ..."
        text = NIAH_TEMPLATE_ONE.format(v=v, context=context, query=query)
        prefix = NIAH_PREFIX_ONE.format(v=v, query=query)
    else:
        text, prefix = NIAH_TEMPLATE.format(vs=vs, context=context, query=query), NIAH_PREFIX.format(vs=vs, query=query)
    return hs.Sample(text, prefix, references, {"keys": key_list, "values": value_list, "queries": queries,
                                                "needles": needles, "fractions": fractions})


def _chain_vars(rng: random.Random, count: int) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    return names


def _vt_input(rng: random.Random, n: int, chains: int, hops: int) -> tuple[str, str, list[str], list[list[str]]]:
    names = _chain_vars(rng, chains * (hops + 1))
    groups = [names[i:i + hops + 1] for i in range(0, len(names), hops + 1)]
    lines = []
    for g in groups:
        chain = [f"VAR {g[0]} = {rng.randint(10000, 99999)}"] + [f"VAR {g[j + 1]} = VAR {g[j]} " for j in range(hops)]
        lines.append(chain)
    value = lines[0][0].split("=")[-1].strip()
    units = [hs.NOISE] * n
    for chain in lines:  # each chain's lines in order, at random places (RULER: insert at sorted positions)
        at = sorted(rng.sample(range(len(units)), len(chain))) if len(units) >= len(chain) else [0] * len(chain)
        for j, pos in enumerate(at):
            units.insert(pos + j, chain[j])
    context = "\n".join(units).replace(". \n", ".\n")
    return (VT_TEMPLATE.format(context=context, query=value), VT_PREFIX.format(n=hops + 1, query=value), groups[0],
            lines)


def vt(rng: random.Random, n: int, src: hs.Source, chains: int = 1, hops: int = 4) -> hs.Sample:
    """Variable tracking, with RULER's one worked example first (a short chain in 5 noise lines, answered)."""
    ex_text, ex_prefix, ex_answer, _ = _vt_input(rng, 5, chains, hops)
    example = ex_text + ex_prefix + " " + " ".join(ex_answer) + "\n"
    text, prefix, answer, lines = _vt_input(rng, n, chains, hops)
    return hs.Sample(example + "\n" + text, prefix, answer, {"chains": lines})


def _cwe_list(rng: random.Random, words: list[str], common: int, repeats_common: int,
              repeats_other: int) -> tuple[str, list[str]]:
    chosen = rng.sample(words, len(words))
    top, rest = chosen[:common], chosen[common:]
    items = top * repeats_common + rest * repeats_other
    rng.shuffle(items)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)), top


def cwe(rng: random.Random, n: int, src: hs.Source, length: int = 4096, common: int = 10) -> hs.Sample:
    """Common words extraction: n distinct words, `common` of them repeated 30 times and the rest 3 times (6 and 1
    below 4k tokens), after one worked example (40 words, 10 and 3 times; 20 words, 3 and 1 below 4k)."""
    if n + 40 > len(src.pool):
        raise ValueError(f"cwe needs {n + 40} different words but the text has {len(src.pool)}; give more text "
                         "(--text-files)")
    rc, ro, ex_n, ex_rc, ex_ro = (30, 3, 40, 10, 3) if length >= 4096 else (6, 1, 20, 3, 1)
    words = rng.sample(src.pool, n + ex_n)
    ex_context, ex_top = _cwe_list(rng, words[n:], common, ex_rc, ex_ro)
    example = CWE_TEMPLATE.format(context=ex_context) + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_top))
    context, top = _cwe_list(rng, words[:n], common, rc, ro)
    return hs.Sample(example + "\n" + CWE_TEMPLATE.format(context=context), CWE_PREFIX, top,
                     {"repeats": (rc, ro), "words": words[:n]})


def _zeta(s: float) -> float:
    """Riemann zeta for s > 1 (Euler-Maclaurin after 50 terms: exact to ~1e-12 for s >= 1.5)."""
    n = 50
    head = sum(k ** -s for k in range(1, n))
    return head + n ** (1 - s) / (s - 1) + n ** -s / 2 + s * n ** (-s - 1) / 12


def fwe(rng: random.Random, n: int, src: hs.Source, length: int = 4096, alpha: float = 2.0,
        word_len: int = 6) -> hs.Sample:
    """Frequent words extraction: a vocabulary of (length - 50) // 50 random coded words, word k (1-based) written
    int(n k^-alpha / zeta(alpha)) times, shuffled; the first word is '...' (noise the question says to ignore), the
    answer the next three."""
    size = max(8, (length - 50) // 50)
    vocab: list[str] = []
    seen = set()
    while len(vocab) < size:
        w = "".join(rng.choices(string.ascii_lowercase, k=word_len))
        if w not in seen:
            seen.add(w)
            vocab.append(w)
    vocab[0] = "..."
    z = _zeta(alpha)
    counts = [int(n * k ** -alpha / z) for k in range(1, size + 1)]
    items = [w for w, c in zip(vocab, counts) for _ in range(c)]
    rng.shuffle(items)
    return hs.Sample(FWE_TEMPLATE.format(context=" ".join(items)), FWE_PREFIX, vocab[1:4],
                     {"counts": dict(zip(vocab, counts))})


# name: (generator, keyword arguments, tokens to generate (RULER's), smallest haystack size)
TASKS: dict[str, tuple[Callable[..., hs.Sample], dict[str, Any], int, int]] = {
    name: (niah, opts, 128, 1) for name, opts in NIAH.items()}
TASKS.update({"vt": (vt, {}, 30, 1), "cwe": (cwe, {}, 120, 11), "fwe": (fwe, {}, 50, 20)})


def generate(task: str, rng_seed: str, n: int, src: hs.Source, length: int) -> hs.Sample:
    fn, opts, _, _ = TASKS[task]
    kwargs = dict(opts)
    if fn in (cwe, fwe):
        kwargs["length"] = length
    return fn(random.Random(rng_seed), n, src, **kwargs)


def build(prompter: hs.Prompter, src: hs.Source, task: str, length: int, seed: str,
          sizes: dict) -> tuple[hs.Sample, list[int]]:
    """(sample, token ids): the task's largest prompt that leaves room for its generated tokens in `length`
    (RULER: prompt + generation <= length). `sizes` remembers the haystack size found per (task, length), where
    the next sample's search starts."""
    new, low = TASKS[task][2], TASKS[task][3]
    high = max(low, 4 * length)  # a haystack unit costs at least a token: a safe upper bound
    if task == "cwe":
        high = min(high, len(src.pool) - 40)
    try:
        n, sample = hs.fit(lambda m: generate(task, seed, m, src, length), lambda s: len(prompter.ids(s)),
                           length - new, low, high, sizes.get((task, length)))
    except hs.NoRoom as e:
        # the smallest length that holds the template and question: budget + new, so the budget's sign never shows
        raise ValueError(f"{task} at length {length}: too short; its template and question take {e.tokens} tokens "
                         f"with the smallest haystack, and it generates {new}: use lengths of at least "
                         f"{e.tokens + new} (a few more where a sample's random keys are longer)") from None
    except ValueError as e:
        raise ValueError(f"{task} at length {length}: {e}") from None
    sizes[(task, length)] = n
    return sample, prompter.ids(sample)


def parse_tasks(text: str) -> list[str]:
    names = list(TASKS) if text.strip() == "all" else [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in TASKS]
    if unknown or not names:
        raise ValueError(f"unknown RULER task(s) {', '.join(unknown) or '(none given)'}; the tasks: "
                         f"{', '.join(TASKS)} (or all)")
    if len(set(names)) != len(names):
        raise ValueError(f"--tasks repeats a task: {text}")
    return names


class Ruler(definition.Evaluation):
    records = "samples"
    unit_key = "sample"
    axes: ClassVar[dict[str, str]] = {"tasks": "task", "lengths": "length"}

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--tasks", default="all", help=f"comma-separated tasks or all (default): {', '.join(TASKS)}")
        p.add_argument("--lengths", default="4k,8k,16k", help="prompt + generation lengths, k = 1024 "
                                                             "(default 4k,8k,16k)")
        p.add_argument("--samples", type=int, default=20, help="samples per (task, length) (default 20)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--text-files", nargs="+", metavar="PATH",
                       help="real text for the haystacks and the words (default: the default corpus)")
        p.add_argument("--chat-template", action="store_true", dest="chat_template",
                       help="wrap each task in the tokenizer's chat template (default: plain text, RULER's base)")

    def plan(self, args: argparse.Namespace, tok: Any) -> definition.Plan:
        tasks, lengths = parse_tasks(args.tasks), parse_lengths(args.lengths)
        definition.check_count("--samples", args.samples)
        source = texts.describe_source(args.text_files)
        src = hs.source(args.text_files)
        if not src.pool:  # keys and word lists are drawn from it
            raise ValueError("the text has no words of 3 to 10 lowercase letters to draw RULER's keys and word lists "
                             "from; give other text (--text-files)")
        prompter = hs.Prompter(tok, args.chat_template)
        sizes: dict[tuple[str, int], int] = {}
        first = {(t, n): build(prompter, src, t, n, f"{args.seed}:{t}:{n}:0", sizes) for t in tasks for n in lengths}
        if args.samples > 1:  # every (task, length) fits: the input is valid; now the long part
            print(f"{self.prog}: generating {len(first) * (args.samples - 1)} more prompts", file=sys.stderr)
        cells = []
        for task in tasks:
            new = TASKS[task][2]
            for n in lengths:
                units = []
                for i in range(args.samples):  # the same prompts for every spec and after a resume
                    sample, ids = first[(task, n)] if i == 0 else build(prompter, src, task, n,
                                                                         f"{args.seed}:{task}:{n}:{i}", sizes)
                    units.append(definition.Unit(i, definition.decoding(len(ids), new), (ids, sample.references, new)))
                cells.append(definition.Cell({"task": task, "length": n}, units))
        identity = {"model": args.model, "dtype": args.dtype, "seed": args.seed, "haystack": source,
                    "chat_template": args.chat_template, "text_sha256": src.sha256}
        settings = {"tasks": tasks, "lengths": lengths, "samples": args.samples, "dtype": args.dtype,
                    "device_map": args.device_map}
        return definition.Plan(identity, cells, read=max(lengths), new_tokens=max(TASKS[t][2] for t in tasks),
                          info={"settings": settings})

    def run_unit(self, run: Any, cell: dict, unit: Any, progress: Any) -> dict:
        ids, references, new = unit.data
        eos = {i for i in [run.tok.eos_token_id] if i is not None}
        answer = run.tok.decode(run.greedy(ids, new, eos, hs.all_found(run.tok, references)),
                                skip_special_tokens=True)
        return {"prompt_tokens": len(ids), "references": references, "answer": answer,
                "score": hs.string_match_all(hs.postprocess(answer), references)}

    def summarize(self, records: list[dict]) -> dict:
        n = len(records)
        score = sum(r["score"] for r in records) / n
        low, high = wilson(score, n)
        return {"score": score, "n": n, "ci95": [low, high]}

    def caption(self, data: dict) -> str:
        name = data.get("model", {}).get("name", data["identity"]["model"])
        return (f"{name}: RULER, {data['settings']['samples']} sample(s) per task and length, greedy decoding; "
                "score % [95 % Wilson interval]")

    def tables(self, data: dict) -> str:
        """One table per patch spec: rows = task (+ the mean over tasks), columns = length, entries = score % [CI]."""
        s = data["settings"]
        tasks, lengths = s["tasks"], s["lengths"]
        done = {(c["patch"], c["task"], c["length"]): c for c in report.complete(data["cells"])}
        out = []
        for p in s["patches"]:
            rows = [[t] + [_percent(c["score"], c["ci95"]) if (c := done.get((p, t, n))) else "—" for n in lengths]
                    for t in tasks]
            mean = []
            for n in lengths:
                cs: list = [done.get((p, t, n)) for t in tasks]  # None for a missing cell: checked below
                mean.append("—" if None in cs else _percent(*_score_and_interval(pooled(cs))))
            if len(tasks) > 1:
                rows.append(["**mean**", *mean])
            out.append(f"**{p}**\n\n" + report.markdown_table(["task"] + [length_label(n) for n in lengths], rows))
        return "\n\n".join(out)

    def plot(self, data: dict, path: Path | str, title: str) -> None:
        """Score vs length, one line per patch spec with its 95 % interval as error bars: one panel for the mean over
        the tasks (samples pooled) and one per task."""
        s, window = data["settings"], data.get("model", {}).get("trained_window")
        patches, tasks, lengths = s["patches"], s["tasks"], s["lengths"]
        done = {(c["patch"], c["task"], c["length"]): c for c in report.complete(data["cells"])}
        panels = (["mean"] if len(tasks) > 1 else []) + list(tasks)
        cols = min(4, len(panels))
        rows = -(-len(panels) // cols)
        fig = plots.figure(figsize=(3.2 * cols, 2.6 * rows + 0.6))
        axes = fig.subplots(rows, cols, squeeze=False, sharey=True)
        colors = plots.colors()
        for k, panel in enumerate(panels):
            ax = axes[k // cols][k % cols]
            for i, p in enumerate(patches):
                pts = []
                for n in lengths:
                    cs: list = [done.get((p, t, n)) for t in (tasks if panel == "mean" else [panel])]  # as above
                    if None not in cs:
                        score, _, (lo, hi) = pooled(cs)
                        pts.append((n, score, lo, hi))
                if pts:
                    xs, scores, los, his = zip(*pts)
                    dodge = 1.06 ** (i - (len(patches) - 1) / 2)  # side by side, so that equal scores stay visible
                    ys = [100 * y for y in scores]
                    err = [[y - 100 * lo for y, lo in zip(ys, los)], [100 * hi - y for y, hi in zip(ys, his)]]
                    ax.errorbar([x * dodge for x in xs], ys, yerr=err, marker="o", markersize=4, capsize=2,
                                color=colors[i % len(colors)], label=p)
            if plots.shows_window(window, lengths):
                ax.axvline(window, color="gray", linestyle=":", linewidth=1)
            plots.length_axis(ax, lengths)
            ax.set_ylim(-5, 105)
            ax.set_title(panel if panel != "mean" else "mean over tasks", fontsize=9)
            ax.grid(True, alpha=0.3)
            if k % cols == 0:
                ax.set_ylabel("score (%)")
        for k in range(len(panels), rows * cols):
            axes[k // cols][k % cols].axis("off")
        axes[0][0].legend(fontsize=7)
        if title:
            fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=120)


def _percent(p: float, ci: Any) -> str:
    return f"{100 * p:.0f} [{100 * ci[0]:.0f}, {100 * ci[1]:.0f}]"


def _score_and_interval(pooled_result: Any) -> tuple[Any, Any]:
    p, _, ci = pooled_result
    return p, ci


EVALUATION = Ruler()
main = EVALUATION.main
