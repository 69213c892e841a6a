"""The windows that score a span of tokens (chunks, sliding, rolling): pure arithmetic on token counts, apart from
the model (causal.py scores them), so that an evaluation can plan its units without importing torch."""

from __future__ import annotations


def windows(n_tokens: int, length: int, windowing: str, stride: int | None = None) -> list[tuple[int, int, int]]:
    """The windows that score a span of n_tokens, as (start, end, first): the tokens at start+first .. end-1 are
    scored, each given everything before it in ids[start:end] (window_nll reads ids[start:end-1]).

    chunks:  non-overlapping windows of `length` tokens, each scored whole (its first token is context only);
             a tail shorter than `length` is not scored.
    sliding: windows of `length` tokens, ending `stride` tokens apart (Press et al.); the first is scored whole,
             each later one scores only the tokens no earlier window scored. The last window ends at the span's
             end (it may move less than `stride`), so every token but the first is scored exactly once and every
             window is `length` tokens long.
    rolling: lm-evaluation-harness's loglikelihood_rolling. ids[0] is a prefix token (BOS, else EOS) put before
             the span; every token after it is scored once, in disjoint runs of `length` predictions, each read
             from the `length` tokens before its last prediction (the first run from the prefix on; the last run
             may be shorter and reads the `length` tokens before its end). These are sliding windows of
             length + 1 tokens ending `length` apart, so the model reads `length` tokens per window.
    """
    if windowing == "rolling":
        return windows(n_tokens, length + 1, "sliding", length)
    if length < 2 or n_tokens < length:
        raise ValueError(f"a window of {length} tokens does not fit in {n_tokens} tokens")
    if windowing == "chunks":
        return [(k * length, (k + 1) * length, 1) for k in range(n_tokens // length)]
    if windowing != "sliding":
        raise ValueError(f"windowing must be 'chunks', 'sliding' or 'rolling', got {windowing!r}")
    if not stride or not 1 <= stride < length:  # stride = length would be chunks, less the first token of each
        raise ValueError(f"stride must be between 1 and the length - 1 ({length - 1}), got {stride}")
    ends = list(range(length, n_tokens + 1, stride))
    if ends[-1] != n_tokens:
        ends.append(n_tokens)
    out, scored_to = [], 0
    for end in ends:
        start = end - length
        out.append((start, end, max(1, scored_to - start)))
        scored_to = end
    return out
