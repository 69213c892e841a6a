"""The objective `hfpatch search` minimises: needle-driven perplexity at the target length (LongRoPE2), plain
perplexity there, and a guard on perplexity at the trained window.

Plain perplexity over a long text is dominated by tokens that a short context already predicts; a patch that
breaks far retrieval barely moves it. So, as LongRoPE2 does, the search scores the loss on the tokens whose
prediction *needs* context further back than the trained window W. Each calibration sample is `target` tokens of
real text with two such things built in, at token level:
  - a passkey: "The pass key is 48213. Remember it. 48213 is the pass key." planted more than W tokens before
    "What is the pass key? The pass key is 48213" at the end; the loss on the answer's tokens;
  - a repeated span: `span` tokens of the text copied from more than W tokens back to just before the question;
    the loss on their second occurrence (its first token excluded: nothing announces where a copy starts).
Those tokens are the "needle" tokens; every other scored token is "plain". A sample's record holds the NLL sums
and counts of both, and of the sample's first W tokens read alone (the short-context guard).

score = needle_weight x mean needle NLL + (1 - needle_weight) x mean plain NLL (in nats; exp of each mean is the
perplexity). A candidate is feasible when its perplexity at the trained window is at most (1 + guard) times the
unpatched model's: a patch that wins far away but costs short prompts is not chosen.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..evaluate import haystack
from ..lm.causal import LMParts, head_logits, window_nll
from ..lm.text import Document, tokenize

NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"


@dataclass
class Sample:
    ids: list[int]  # `target` tokens
    needle: list[tuple[int, int]]  # [start, end) runs of token positions scored as needle tokens


def _piece(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False, verbose=False)["input_ids"])


def shortest_target(tok: Any, window: int, span: int) -> int:
    """The shortest target length whose samples hold the passkey and the span, each more than `window` tokens from
    where it is asked for (with the widest key)."""
    needle = len(_piece(tok, NEEDLE.format(key="99999")))
    question = len(_piece(tok, QUESTION + " 99999"))
    return needle + span + window + span + question + 2


def build(tok: Any, docs: list[Document], target: int, window: int, samples: int, span: int, seed: int) -> list[Sample]:
    """`samples` calibration samples of `target` tokens, cut in order from the documents' tokens joined; every
    random choice (key, depths) from a generator seeded by the seed and the sample's number."""
    need = shortest_target(tok, window, span)
    if target < need:
        raise ValueError(f"--target-length {target} is too short for a passkey and a {span}-token span each more "
                         f"than the trained window ({window}) back: use at least {need}")
    text = np.concatenate([tokenize(tok, d).ids for d in docs]) if docs else np.zeros(0, dtype=np.int64)
    if len(text) < samples * target:
        raise ValueError(f"the calibration text has {len(text)} tokens; {samples} sample(s) of {target} tokens need "
                         f"{samples * target}: give more text (--text-files) or fewer --samples")
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    out = []
    for k in range(samples):
        rng = random.Random(f"search-sample:{seed}:{k}")
        key = haystack.number(rng, 5)
        needle, question, answer = _piece(tok, NEEDLE.format(key=key)), _piece(tok, QUESTION), _piece(tok, " " + key)
        body = [int(t) for t in text[k * target:(k + 1) * target]]
        room = target - len(bos) - len(needle) - span - len(question) - len(answer)
        if room < window + span:  # a tokenizer that splits this key into more tokens than the widest one
            raise ValueError(f"--target-length {target} is too short for sample {k}'s passkey; use at least "
                             f"{target + window + span - room}")
        # the needle ends, and the span's source ends, more than `window` tokens before what asks for them
        depth = rng.randrange(0, room - window - span + 1)
        text_part = body[:depth] + needle + body[depth:room]
        src = rng.randrange(0, len(text_part) - window - span + 1)
        ids = bos + text_part + text_part[src:src + span] + question + answer
        start_copy = len(bos) + room + len(needle)
        start_answer = len(ids) - len(answer)
        out.append(Sample(ids, [(start_copy + 1, start_copy + span), (start_answer, len(ids))]))
    return out


@torch.no_grad()
def token_nll(parts: LMParts, ids: list[int], chunk: int = 1024) -> torch.Tensor:
    """-log p(ids[t] | ids[:t]) for t = 1 .. len - 1 (float64, index t - 1), from one forward of ids[:-1], the LM
    head `chunk` positions at a time."""
    x = torch.tensor([ids], device=parts.input_device)
    out = parts.base(input_ids=x[:, :-1], use_cache=False)
    h = (out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])[0]
    targets = x[0, 1:]
    nll = torch.empty(h.shape[0], dtype=torch.float64)
    for i in range(0, h.shape[0], chunk):
        logits = head_logits(parts, h[i:i + chunk])
        step = F.cross_entropy(logits, targets[i:i + chunk].to(logits.device), reduction="none")
        nll[i:i + chunk] = step.double().cpu()
    return nll


def score_sample(parts: LMParts, sample: Sample, window: int) -> dict:
    """A sample's record: NLL sums and token counts of its needle tokens, its other tokens, and its first `window`
    tokens read alone."""
    nll = token_nll(parts, sample.ids)
    mask = torch.zeros(len(sample.ids), dtype=torch.bool)
    for a, b in sample.needle:
        mask[a:b] = True
    mask = mask[1:]  # nll[t - 1] scores token t
    short, short_n = window_nll(parts, torch.tensor(sample.ids[:window]))
    return {"needle_nll": float(nll[mask].sum()), "needle_tokens": int(mask.sum()),
            "plain_nll": float(nll[~mask].sum()), "plain_tokens": int((~mask).sum()),
            "short_nll": short, "short_tokens": short_n}


def _ppl(total: float, n: int) -> float | None:
    if n == 0 or not math.isfinite(total):
        return None
    mean = total / n
    return math.exp(mean) if mean < 700 else None


def summarize(records: list[dict], needle_weight: float) -> dict:
    """A candidate's numbers from its samples' records (None where there are none, or one overflowed)."""
    sums = {k: sum(r[k] for r in records) for k in ("needle_nll", "needle_tokens", "plain_nll", "plain_tokens",
                                                     "short_nll", "short_tokens")}
    out: dict = {name: _ppl(sums[f"{name}_nll"], sums[f"{name}_tokens"]) for name in ("needle", "plain", "short")}
    out = {f"{k}_ppl": v for k, v in out.items()}
    if out["needle_ppl"] is None or out["plain_ppl"] is None:
        out["score"] = None
    else:
        out["score"] = (needle_weight * sums["needle_nll"] / sums["needle_tokens"]
                        + (1 - needle_weight) * sums["plain_nll"] / sums["plain_tokens"])
    return out


def feasible(cell: dict, baseline_short: float | None, guard: float) -> bool:
    """Whether a scored candidate keeps perplexity at the trained window within the guard."""
    if cell.get("score") is None or cell.get("short_ppl") is None:
        return False
    return baseline_short is None or cell["short_ppl"] <= baseline_short * (1 + guard)
