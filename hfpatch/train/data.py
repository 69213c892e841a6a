"""Training data: documents (text files, a `datasets` dataset) tokenized once (cached, see hfpatch.lm.text),
joined with the EOS token between documents, packed into fixed-length sequences, and split into a training and a
held-out set by a seeded shuffle of the packed sequences. The order in which training sequences are visited is a
pure function of (seed, step), so an interrupted run that resumes sees exactly the batches it would have seen.
"""

from __future__ import annotations

import torch

from ..lm.text import documents, joined_ids
from .config import ConfigError, RecipeConfig


def packed(cfg: RecipeConfig, tok) -> tuple[torch.Tensor, torch.Tensor]:
    """(train [N, seq_len], held-out [M, seq_len]) int64 token ids."""
    d = cfg.data
    files = [d.text_files] if isinstance(d.text_files, str) else d.text_files
    try:  # unreadable or non-UTF-8 files, a folder without .txt files, a dataset that cannot be loaded
        docs = documents(text_files_arg=files, dataset=d.dataset, config=d.config, split=d.split,
                         text_field=d.text_field)
        ids = joined_ids(tok, docs, d.max_tokens)
    except (ValueError, OSError) as e:
        raise ConfigError(f"data: {' '.join(str(e).split())}") from None
    n = len(ids) // cfg.seq_len
    if n < 2:
        raise ConfigError(f"the data holds {len(ids)} tokens: fewer than two sequences of seq_len={cfg.seq_len}; "
                          "give more text or lower seq_len")
    seqs = torch.from_numpy(ids[: n * cfg.seq_len].copy()).view(n, cfg.seq_len)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed))
    n_eval = round(n * d.eval_fraction)
    n_eval = min(max(n_eval, 1 if d.eval_fraction > 0 else 0), n - 1)
    return seqs[order[n_eval:]], seqs[order[:n_eval]]


def batch_indices(n: int, global_batch: int, step: int, seed: int) -> torch.Tensor:
    """The sequence indices of global batch `step` (0-based): epochs are seeded permutations of range(n), read
    in order, wrapping into the next epoch."""
    out: list = []
    start = step * global_batch
    while len(out) < global_batch:
        epoch, offset = divmod(start + len(out), n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        out.extend(perm[offset: offset + global_batch - len(out)].tolist())
    return torch.tensor(out)
