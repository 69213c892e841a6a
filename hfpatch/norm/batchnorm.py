"""norm="batchnorm": where the norms learn which tokens are padding.

A norm module only sees hidden states; which positions are padding is in the attention mask the model's forward was
given. The base model's instance gets a mixin (`RecordsPadding`, through `Edits.mix_in`) whose forward records that
mask in a `PaddingMask` before running the model's own forward; every BatchNorm of the model holds the same
`PaddingMask` and reads, for its input [batch, seq, ...], the last `seq` columns of the recorded mask (with a KV
cache the mask covers the cached tokens too, and the current tokens are the last ones).

Chosen this way because the mask is recorded once per call, at the one place every caller goes through (the
CausalLM head, generate() and the recipes' loss all call the base model), without touching the blocks. The mask
stays recorded after the call (until the next one replaces it), so that gradient checkpointing, which recomputes
blocks during the backward pass, sees the same tokens as the forward. Running statistics are then updated twice per
step, as torch's own BatchNorm is under checkpointing.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from ..edits import Edits
from .modules import BatchNorm

PADDING_ATTR = "hfpatch_padding"


class PaddingMask:
    """The real (non-padding) tokens of the current forward: a [batch, length] bool tensor, or None (all real)."""

    def __init__(self):
        self.mask = None

    def record(self, attention_mask) -> None:
        if attention_mask is None:
            self.mask = None
            return
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
            raise ValueError("norm='batchnorm' reads which tokens are padding from a 2D attention_mask [batch, length] "
                             f"(1 = token, 0 = padding); got {shape}. Pass a 2D mask, or none when nothing is padded")
        self.mask = attention_mask.bool()

    def keep(self, h: torch.Tensor) -> torch.Tensor | None:
        """Flat bool over h.reshape(-1, channels): which rows are real tokens (None: all)."""
        if self.mask is None:
            return None
        b, length = h.shape[0], h.shape[1]
        if h.dim() < 3 or self.mask.shape[0] != b or self.mask.shape[1] < length:
            raise ValueError(f"batchnorm: the attention mask {tuple(self.mask.shape)} does not cover an input of "
                             f"shape {tuple(h.shape)} (expected [batch, seq, ..., channels])")
        m = self.mask[:, -length:].to(h.device)
        return m.reshape(b, length, *([1] * (h.dim() - 3))).expand(h.shape[:-1]).reshape(-1)


class RecordsPadding:
    """Mixed into the base model: records the attention mask of each call in its PaddingMask."""

    def forward(self, *args, **kwargs):
        if "attention_mask" in kwargs or not args:
            mask = kwargs.get("attention_mask")
        else:  # positional: bind them the way the model's forward reads them
            mask = inspect.signature(super().forward).bind_partial(*args, **kwargs).arguments.get("attention_mask")
        getattr(self, PADDING_ATTR).record(mask)
        return super().forward(*args, **kwargs)


def attach(model, edits: Edits) -> PaddingMask:
    """Make the base model record its attention mask; returns the PaddingMask its BatchNorms should read."""
    base = model.base_model
    padding = PaddingMask()
    edits.set(base, PADDING_ATTR, padding)
    edits.mix_in(base, RecordsPadding)
    return padding


@contextlib.contextmanager
def batch_statistics(model):
    """Inside: every BatchNorm of `model` normalises with the statistics of the batch it is given, even in eval(),
    and leaves its running statistics alone."""
    norms = [m for m in model.modules() if isinstance(m, BatchNorm)]
    before = [m.use_batch_statistics for m in norms]
    for m in norms:
        m.use_batch_statistics = True
    try:
        yield model
    finally:
        for m, b in zip(norms, before):
            m.use_batch_statistics = b
