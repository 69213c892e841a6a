"""PoSE, positional skip-wise training (Zhu et al., ICLR 2024): train on `seq_len` tokens whose position ids are
spread over a `target_len` window, so that the model sees the relative distances of the target window at the cost
of `seq_len`.

Each sequence is cut into `chunks` pieces at random points (lengths l_0..l_{N-1}, summing to seq_len); piece i
keeps consecutive positions but is shifted by a skip u_i, drawn as in the paper: u_0 = 0, u_i uniform in
{u_{i-1}, ..., target_len - seq_len}. The positions are therefore increasing, start at 0 and end at most at
target_len - 1. The text of a sequence stays contiguous (the paper's v_i = 0 variant): the packed sequences of the
recipes are used as they are.

The skips of a sequence are a pure function of (seed, index of the sequence in the run), so an interrupted run that
resumes trains on exactly the positions it would have seen.
"""

from __future__ import annotations

import numpy as np
import torch


def position_ids(seq_len: int, target_len: int, chunks: int, seed: int, sample: int) -> torch.Tensor:
    """[seq_len] int64 PoSE position ids of sequence number `sample` (0, 1, 2, ... over the whole run)."""
    rng = np.random.default_rng([seed, sample, 0x9053])  # 0x9053: a stream of its own, apart from other seeded draws
    n = min(chunks, seq_len)
    cuts = np.sort(rng.choice(np.arange(1, seq_len), size=n - 1, replace=False)) if n > 1 else np.zeros(0, np.int64)
    starts = np.concatenate([[0], cuts])
    lengths = np.diff(np.concatenate([starts, [seq_len]]))
    room = target_len - seq_len
    skips = np.zeros(n, np.int64)
    for i in range(1, n):
        skips[i] = rng.integers(skips[i - 1], room + 1)
    return torch.from_numpy(np.arange(seq_len) + np.repeat(skips, lengths))


def batch_position_ids(seq_len: int, target_len: int, chunks: int, seed: int, first_sample: int,
                       batch: int) -> torch.Tensor:
    """[batch, seq_len]: the position ids of samples first_sample .. first_sample + batch - 1."""
    return torch.stack([position_ids(seq_len, target_len, chunks, seed, first_sample + b) for b in range(batch)])
