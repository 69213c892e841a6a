"""Building long prompts with things hidden in them, offline and deterministically: haystacks (repeated noise,
real text, or other needles), needles placed at depths, random keys and values, and fitting a prompt to a token
budget. Shared by the RULER tasks (ruler.py) and the needle-in-a-haystack heatmap (niah.py).

Every random choice comes from a `random.Random` seeded by a string (Python hashes str seeds deterministically), so
a sample is the same for every patch spec, after a resume, and on every machine.
"""

from __future__ import annotations

import hashlib
import random
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..lm import text as texts

T = TypeVar("T")  # what a fit() build makes

# The repeated noise of the passkey test, which RULER also uses as its "noise" haystack.
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
# RULER's needle depths: 40 points from 0 to 100 % of the haystack.
DEPTHS = [round(100 * i / 39) for i in range(40)]


@dataclass
class Sample:
    """One prompt: `input` (everything before the answer prefix), `answer_prefix` (the start of the answer,
    after which the model continues), `references` (what a correct answer contains), and what the generator knows
    about it (for checking answer keys: needle positions, chains, counts)."""

    input: str
    answer_prefix: str
    references: list[str]
    facts: dict = field(default_factory=dict)


class Source:
    """Real text for haystacks and the words that keys and word lists are drawn from: the documents' text with
    whitespace collapsed, its words, and its distinct lowercase words of 3-10 letters (sorted)."""

    def __init__(self, text: str) -> None:
        self.text = re.sub(r"\s+", " ", text).strip()
        self.words = self.text.split(" ") if self.text else []
        self.pool = sorted(set(re.findall(r"\b[a-z]{3,10}\b", self.text)))
        self.sha256 = hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    def first_words(self, n: int) -> str:
        """The first n words of the text, the text repeated as often as needed (RULER's essay haystack)."""
        reps = -(-n // len(self.words))
        return " ".join((self.words * reps)[:n])


def source(text_files: Any) -> Source:
    """The haystack text: the given files, or the default corpus."""
    docs = texts.text_files(text_files) if text_files else texts.default_corpus()
    src = Source(" ".join(d.text for d in docs))
    if not src.words:
        raise ValueError(f"the haystack text ({', '.join(map(str, text_files or ['the default corpus']))}) has no "
                         "words; give text files with text in them")
    return src


class Prompter:
    """A sample as the model reads it: the task text and the answer prefix (RULER's "base" template), or, with
    `chat`, the task text as a user message in the tokenizer's chat template and the answer prefix after it."""

    def __init__(self, tok: Any, chat: bool) -> None:
        self.tok, self.chat = tok, chat
        if chat and not getattr(tok, "chat_template", None):
            raise ValueError("--chat-template: this tokenizer has no chat template")

    def text(self, sample: Sample) -> str:
        if not self.chat:
            return sample.input + sample.answer_prefix
        head = self.tok.apply_chat_template([{"role": "user", "content": sample.input}], tokenize=False,
                                            add_generation_prompt=True)
        return head + sample.answer_prefix.lstrip()

    def ids(self, sample: Sample) -> list[int]:
        # a chat template writes the special tokens itself
        return self.tok(self.text(sample), add_special_tokens=not self.chat, verbose=False)["input_ids"]


def postprocess(answer: str) -> str:
    """RULER's clean-up of an answer: strip, control characters become newlines."""
    return re.sub(r"[\x00-\x1f]", "\n", answer.strip()).strip()


def string_match_all(answer: str, references: list[str]) -> float:
    """RULER's score of an answer: the share of the references found in it (case-insensitive substrings)."""
    a = answer.lower()
    return sum(r.lower() in a for r in references) / len(references)


def all_found(tok: Any, references: list[str]) -> Callable[[list[int]], bool]:
    """A stop test for greedy decoding: True once every reference is in the answer so far. The score is the share
    of references found, which more text cannot lower, so stopping there gives the score of the full answer
    (and saves the decoding steps of every answer that got it right early)."""
    def done(generated: list[int]) -> bool:
        return string_match_all(postprocess(tok.decode(generated, skip_special_tokens=True)), references) == 1.0

    return done


def string_match_part(answer: str, references: list[str]) -> float:
    """RULER's QA score: 1 if any reference is found in the answer (kept for tasks with alternative answers)."""
    a = answer.lower()
    return float(any(r.lower() in a for r in references))


def sentences(text: str) -> list[str]:
    """Split text after ., ! or ? followed by a space (a simple splitter: what matters is that needles go between
    sentences, not inside words)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


def number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def uuid4(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def word_pair(rng: random.Random, pool: list[str]) -> str:
    """Two words of the pool joined by a hyphen (RULER: an adjective-noun pair such as 'sleepy-owl')."""
    return f"{rng.choice(pool)}-{rng.choice(pool)}"


def value(kind: str, rng: random.Random, pool: list[str]) -> str:
    if kind == "numbers":
        return number(rng)
    if kind == "uuids":
        return uuid4(rng)
    if kind == "words":
        return word_pair(rng, pool)
    raise ValueError(f"unknown value kind {kind!r}: numbers, words or uuids")


def distinct(kind: str, rng: random.Random, pool: list[str], count: int, avoid: Iterable[str] = ()) -> list[str]:
    """`count` different values, none in `avoid`."""
    out: list[str] = []
    taken = set(avoid)
    for _ in range(100 * count + 100):
        if len(out) == count:
            return out
        v = value(kind, rng, pool)
        if v not in taken:
            out.append(v)
            taken.add(v)
    raise ValueError(f"cannot draw {count} different {kind} from a pool of {len(pool)} words; give more text")


def insert(units: list[str], needles: list[str], fractions: list[float]) -> list[str]:
    """Needles placed among units (sentences, lines), needle i before unit int(len(units) * fractions[i])."""
    return insert_at(units, needles, [int(len(units) * f) for f in fractions])


def insert_at(units: list[str], needles: list[str], positions: list[int]) -> list[str]:
    """Needle i placed before unit positions[i]; needles at the same place keep their order."""
    order = sorted(range(len(needles)), key=lambda i: positions[i])
    out, start = [], 0
    for i in order:
        out += [*units[start:positions[i]], needles[i]]
        start = positions[i]
    return out + units[start:]


def boundary(units: list[str], fraction: float) -> int:
    """The sentence boundary at a fraction of the text's length (units joined by spaces): the number of units
    that end at or before it (Kamradt's test: the needle goes at the depth, moved back to a sentence end)."""
    target, end = fraction * (sum(map(len, units)) + len(units) - 1), -1
    for i, u in enumerate(units):
        end += len(u) + 1
        if end > target + 1e-9:
            return i
    return len(units)


class NoRoom(ValueError):
    """fit() found no size that fits its budget: even the smallest build has `tokens` tokens (the caller knows
    what the budget was taken from, and says what length would hold it)."""

    def __init__(self, tokens: int) -> None:
        super().__init__(f"even the smallest prompt has {tokens} tokens")
        self.tokens = tokens


def fit(build: Callable[[int], T], count_tokens: Callable[[T], int], budget: int, low: int, high: int,
        start: int | None = None) -> tuple[int, T]:
    """The largest n in [low, high] whose build(n) has at most `budget` tokens, and that build (build(n) must not
    shrink as n grows). The search starts at `start` (the answer for a similar prompt) or, without one, where the
    token counts of two small builds extrapolate to; it walks in steps of about 1/64 of that until it crosses the
    budget, then bisects the last step."""
    def fits(n: int) -> tuple[int, T] | None:
        built = build(n)
        return (n, built) if count_tokens(built) <= budget else None

    if start is None:  # tokens(n) is close to linear in n: probe two sizes (RULER also extrapolates)
        n1, n2 = low, min(high, low + 64)
        t1 = count_tokens(build(n1))
        t2 = count_tokens(build(n2)) if n2 > n1 else t1
        per = (t2 - t1) / (n2 - n1) if t2 > t1 else 1.0
        start = int(n1 + (budget - t1) / per) if t1 <= budget else low
    step = max(1, start // 64)
    n = max(low, min(start, high))
    best = fits(n)
    if best:  # walk up while it fits; the answer is in (n, n + step)
        while n + step <= high and (up := fits(n + step)):
            best, n = up, n + step
        lo, hi = n + 1, min(high, n + step - 1)
    else:  # walk down until it fits; the answer is in [n, n + step)
        hi = n - 1
        while n - step >= low and not (best := fits(n - step)):
            n, hi = n - step, n - step - 1
        if best:
            n -= step
        lo = n + 1 if best else low
        hi = min(hi, n + step - 1) if best else hi
    while lo <= hi:
        mid = (lo + hi) // 2
        got = fits(mid)
        if got:
            best, lo = got, mid + 1
        else:
            hi = mid - 1
    if best is None:
        raise NoRoom(count_tokens(build(low)))
    return best
