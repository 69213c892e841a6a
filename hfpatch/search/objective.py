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
Those tokens are the "needle" tokens; every other scored token is "plain".

A proxy sample (`build_proxy`) is a full sample with most of its tokens left out: a few segments cut out of it,
each at its own position ids, so that the position ids skip and the sample still spans the target length (PoSE's
idea, used for scoring). It keeps the sample's start (the BOS token and the first text, where attention rests), the
passkey line, the span's source and the end (the copy, the question and the answer), and segments spread evenly
between them: every distance between what is asked and where it was planted is the full sample's own, and the
attention of every scheme (RoPE scalings, Self-Extend, Dual Chunk Attention, the attention temperature) follows the
position ids. The first token after each jump is not scored: its text does not follow the text before it.

The guard reads the calibration text's first W tokens alone (`guard_ids`): a candidate is feasible when its
perplexity there is at most (1 + guard) times the unpatched model's.

score = needle_weight x mean needle NLL + (1 - needle_weight) x mean plain NLL (in nats; exp of each mean is the
perplexity).
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
    ids: list[int]
    needle: list[tuple[int, int]]  # [start, end) runs of token indices scored as needle tokens
    positions: list[int] | None = None  # position ids (None: 0, 1, 2, ...)
    unscored: tuple[int, ...] = ()  # indices of tokens not scored at all (the first token after a jump)
    planted: tuple[tuple[int, int], ...] = ()  # [start, end) of the passkey line and of the span's source


@dataclass(frozen=True)
class Pieces:
    """The token ids of a sample's planted parts."""

    bos: list[int]
    needle: list[int]
    question: list[int]
    answer: list[int]


def _piece(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False, verbose=False)["input_ids"])


def _pieces(tok: Any, key: str) -> Pieces:
    return Pieces([tok.bos_token_id] if tok.bos_token_id is not None else [], _piece(tok, NEEDLE.format(key=key)),
                  _piece(tok, QUESTION), _piece(tok, " " + key))


def shortest_target(tok: Any, window: int, span: int) -> int:
    """The shortest target length whose samples hold the passkey and the span, each more than `window` tokens from
    where it is asked for (with the widest key)."""
    needle = len(_piece(tok, NEEDLE.format(key="99999")))
    question = len(_piece(tok, QUESTION + " 99999"))
    return needle + span + window + span + question + 2


def calibration_ids(tok: Any, docs: list[Document]) -> np.ndarray:
    """The calibration documents' tokens, joined."""
    return np.concatenate([tokenize(tok, d).ids for d in docs]) if docs else np.zeros(0, dtype=np.int64)


def _key_rng(kind: str, seed: int, k: int) -> tuple[random.Random, str]:
    rng = random.Random(f"{kind}:{seed}:{k}")
    return rng, haystack.number(rng, 5)


def build(tok: Any, text: np.ndarray, target: int, window: int, samples: int, span: int, seed: int) -> list[Sample]:
    """`samples` calibration samples of `target` tokens, cut in order from the text's tokens; every random choice
    (key, depths) from a generator seeded by the seed and the sample's number."""
    need = shortest_target(tok, window, span)
    if target < need:
        raise ValueError(f"--target-length {target} is too short for a passkey and a {span}-token span each more "
                         f"than the trained window ({window}) back: use at least {need}")
    if len(text) < samples * target:
        raise ValueError(f"the calibration text has {len(text)} tokens; {samples} sample(s) of {target} tokens need "
                         f"{samples * target}: give more text (--text-files) or fewer --samples")
    out = []
    for k in range(samples):
        rng, key = _key_rng("search-sample", seed, k)
        p = _pieces(tok, key)
        body = [int(t) for t in text[k * target:(k + 1) * target]]
        room = target - len(p.bos) - len(p.needle) - span - len(p.question) - len(p.answer)
        if room < window + span:  # a tokenizer that splits this key into more tokens than the widest one
            raise ValueError(f"--target-length {target} is too short for sample {k}'s passkey; use at least "
                             f"{target + window + span - room}")
        # the needle ends, and the span's source ends, more than `window` tokens before what asks for them
        depth = rng.randrange(0, room - window - span + 1)
        text_part = body[:depth] + p.needle + body[depth:room]
        src = rng.randrange(0, len(text_part) - window - span + 1)
        ids = p.bos + text_part + text_part[src:src + span] + p.question + p.answer
        start_copy = len(p.bos) + room + len(p.needle)
        start_answer = len(ids) - len(p.answer)
        planted = ((len(p.bos) + depth, len(p.bos) + depth + len(p.needle)),
                   (len(p.bos) + src, len(p.bos) + src + span))
        out.append(Sample(ids, [(start_copy + 1, start_copy + span), (start_answer, len(ids))], planted=planted))
    return out


def proxy_misfit(tok: Any, target: int, tokens: int, segments: int, span: int) -> str | None:
    """Why proxy samples of `tokens` tokens in `segments` segments cannot stand for samples of `target` tokens
    (None: they can)."""
    if tokens * 2 > target:
        return f"{tokens} proxy tokens are more than half the target length ({target}): not cheaper"
    if segments < MUST_KEEP:
        return f"{segments} segments cannot keep the start, the passkey, the span's source and the question apart"
    seg = tokens // segments
    needle = len(_piece(tok, NEEDLE.format(key="99999")))
    question = len(_piece(tok, QUESTION + " 99999"))
    if seg < max(needle, span + question) + 2:
        return f"a segment of {seg} tokens cannot hold the passkey line, or the span and the question"
    return None


MUST_KEEP = 4  # segments every proxy sample keeps: the start, the passkey line, the span's source, the end


def build_proxy(tok: Any, full: list[Sample], tokens: int, segments: int, span: int) -> list[Sample]:
    """A proxy sample of each full sample (the module's docstring): `segments` segments of about tokens / segments
    tokens cut out of it at their own positions: its start (the BOS token and the first text, where attention
    rests), the passkey line, the span's source and its end (the copy, the question and the answer), the others
    spread evenly between them (segments that overlap are joined)."""
    why = proxy_misfit(tok, len(full[0].ids), tokens, segments, span)
    if why:
        raise ValueError(f"proxy samples do not fit: {why}")
    return [_cut(sample, tokens // segments, segments) for sample in full]


def _windows(n: int, seg: int, segments: int, planted: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    """The [start, end) slot ranges a proxy keeps of an n-token sample, sorted and joined where they overlap."""
    def around(a: int, b: int) -> tuple[int, int]:
        start = min(max(0, a - (seg - (b - a)) // 2), n - seg)
        return start, start + seg

    kept = [(0, seg), *(around(a, b) for a, b in planted), (n - seg, n)]
    spread = segments - len(kept)
    kept += [(round(i * (n - seg) / (spread + 1)), round(i * (n - seg) / (spread + 1)) + seg)
             for i in range(1, spread + 1)]
    joined: list[tuple[int, int]] = []
    for a, b in sorted(kept):
        if joined and a <= joined[-1][1]:
            joined[-1] = (joined[-1][0], max(joined[-1][1], b))
        else:
            joined.append((a, b))
    return joined


def _cut(sample: Sample, seg: int, segments: int) -> Sample:
    windows = _windows(len(sample.ids), seg, segments, sample.planted)
    ids: list[int] = []
    positions: list[int] = []
    unscored: list[int] = []
    where = {}  # a kept slot -> its index in the proxy
    for a, b in windows:
        if ids:
            unscored.append(len(ids))
        for slot in range(a, b):
            where[slot] = len(ids)
            ids.append(sample.ids[slot])
            positions.append(slot)
    needle = [(where[a], where[b - 1] + 1) for a, b in sample.needle]
    return Sample(ids, needle, positions, tuple(unscored))


def guard_ids(tok: Any, text: np.ndarray, window: int) -> list[int]:
    """The guard's text: the calibration text's first `window` tokens (after the BOS token, if any)."""
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    ids = bos + [int(t) for t in text[: window - len(bos)]]
    if len(ids) < window:
        raise ValueError(f"the calibration text has {len(text)} tokens; the guard reads {window}")
    return ids


@torch.no_grad()
def token_nll(parts: LMParts, ids: list[int], positions: list[int] | None = None, chunk: int = 1024) -> torch.Tensor:
    """-log p(ids[t] | ids[:t]) for t = 1 .. len - 1 (float64, index t - 1), from one forward of ids[:-1] at their
    position ids, the LM head `chunk` positions at a time."""
    x = torch.tensor([ids], device=parts.input_device)
    kwargs: dict[str, Any] = {}
    if positions is not None:
        # with an explicit all-ones mask: without one, transformers reads position ids that jump as the starts of
        # separate packed documents, and masks attention between them
        kwargs["position_ids"] = torch.tensor([positions[:-1]], device=parts.input_device)
        kwargs["attention_mask"] = torch.ones_like(x[:, :-1])
    out = parts.base(input_ids=x[:, :-1], use_cache=False, **kwargs)
    h = (out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])[0]
    targets = x[0, 1:]
    nll = torch.empty(h.shape[0], dtype=torch.float64)
    for i in range(0, h.shape[0], chunk):
        logits = head_logits(parts, h[i:i + chunk])
        step = F.cross_entropy(logits, targets[i:i + chunk].to(logits.device), reduction="none")
        nll[i:i + chunk] = step.double().cpu()
    return nll


def score_sample(parts: LMParts, sample: Sample) -> dict:
    """A sample's record: NLL sums and token counts of its needle tokens and of its other scored tokens."""
    nll = token_nll(parts, sample.ids, sample.positions)
    needle = torch.zeros(len(sample.ids), dtype=torch.bool)
    for a, b in sample.needle:
        needle[a:b] = True
    scored = torch.ones(len(sample.ids), dtype=torch.bool)
    scored[list(sample.unscored)] = False
    needle, plain = needle[1:], (scored & ~needle)[1:]  # nll[t - 1] scores token t
    return {"needle_nll": float(nll[needle].sum()), "needle_tokens": int(needle.sum()),
            "plain_nll": float(nll[plain].sum()), "plain_tokens": int(plain.sum())}


def score_guard(parts: LMParts, ids: list[int]) -> dict:
    """The guard's record: the NLL sum and count of the guard text read alone."""
    total, n = window_nll(parts, torch.tensor(ids))
    return {"short_nll": total, "short_tokens": n}


def _ppl(total: float, n: int) -> float | None:
    if n == 0 or not math.isfinite(total):
        return None
    mean = total / n
    return math.exp(mean) if mean < 700 else None


FIELDS = ("needle_nll", "needle_tokens", "plain_nll", "plain_tokens", "short_nll", "short_tokens")


def summarize(records: list[dict], needle_weight: float) -> dict:
    """A candidate's numbers from its records (samples' and the guard's): perplexities (None where there is nothing
    to count, or one overflowed) and the score (None without needle and plain tokens)."""
    sums = {k: sum(r.get(k, 0) for r in records) for k in FIELDS}
    out: dict = {f"{name}_ppl": _ppl(sums[f"{name}_nll"], sums[f"{name}_tokens"])
                 for name in ("needle", "plain", "short")}
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
