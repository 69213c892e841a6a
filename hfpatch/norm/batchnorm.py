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
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..adapters.probe import restore_modes
from ..edits import Edits
from ..utils.warn import warn_caller
from .modules import BatchNorm

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PADDING_ATTR = "hfpatch_padding"


class PaddingMask:
    """The real (non-padding) tokens of the current forward: a [batch, length] bool tensor, or None (all real)."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None

    def record(self, attention_mask: torch.Tensor | None) -> None:
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


def attach(model: PreTrainedModel, edits: Edits) -> PaddingMask:
    """Make the base model record its attention mask; returns the PaddingMask its BatchNorms should read."""
    base = model.base_model
    padding = PaddingMask()
    edits.set(base, PADDING_ATTR, padding)
    edits.mix_in(base, RecordsPadding)
    return padding


@contextlib.contextmanager
def batch_statistics(model: PreTrainedModel) -> Iterator[PreTrainedModel]:
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


PROBE_BATCH = (4, 64)  # [batch, tokens] of the seeded random batch calibrate() uses when given none


@torch.no_grad()
def calibrate(model: PreTrainedModel, batches: Any = None) -> int:
    """Set the running statistics of every BatchNorm of `model` to the mean and variance of its input over
    `batches` (the model's inputs: a tensor of token ids [batch, seq], a dict such as a tokenizer's output with
    input_ids and attention_mask, or a list of those; None: one seeded batch of random tokens). Each norm normalises
    with the statistics of the batch while this runs, as in training, so each one sees the input the norms before it
    give; the running statistics are the exact average over the batches (not a moving one). Nothing else changes:
    no gradient, no dropout. Returns the number of norms calibrated.

    Fresh running statistics (mean 0, variance 1) normalise nothing: a pretrained model whose norms were swapped
    for BatchNorm gives non-finite or meaningless logits in eval() until they are calibrated or trained."""
    norms = [m for m in model.modules() if isinstance(m, BatchNorm)]
    if not norms:
        raise ValueError("calibrate: the model has no BatchNorm (patch it with norm='batchnorm' first)")
    inputs = model_batches(model, batches)
    modes = [(m, m.training) for m in model.modules()]
    momenta = [m.momentum for m in norms]
    model.eval()
    try:
        for m in norms:
            m.train()
        for i, batch in enumerate(inputs):
            for m in norms:
                m.momentum = 1.0 / (i + 1)  # the running statistics become the average over the batches so far
            model(**batch, use_cache=False)
        for m in norms:
            m.eval()
        out = model(**inputs[0], use_cache=False)
    finally:
        for m, momentum in zip(norms, momenta):
            m.momentum = momentum
        restore_modes(modes)
    logits = out.logits if getattr(out, "logits", None) is not None else out[0]
    if not bool(torch.isfinite(logits).all()):
        warn_caller("hfpatch: calibrate: with the new running statistics the model's logits in eval() are still not "
                    "finite on the first batch: calibrate on more text, real text rather than a probe batch, or train "
                    "the model")
    return len(norms)


def model_batches(model: Any, batches: Any) -> list[dict]:
    if batches is None:
        embeddings = model.get_input_embeddings()
        g = torch.Generator().manual_seed(1234)
        ids = torch.randint(0, embeddings.num_embeddings, PROBE_BATCH, generator=g)
        return [{"input_ids": ids.to(embeddings.weight.device)}]
    items = [batches] if isinstance(batches, torch.Tensor) or hasattr(batches, "keys") else batches
    accepted = "token ids [batch, seq], a dict of model inputs (a tokenizer's output) or a list of those"
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise TypeError(f"calibrate: batches must be {accepted}; got {type(batches).__name__}")
    out = []
    for item in items:
        if not (isinstance(item, torch.Tensor) or hasattr(item, "keys")):
            raise TypeError(f"calibrate: batches must be {accepted}; got a list holding {type(item).__name__}")
        batch = {"input_ids": item} if isinstance(item, torch.Tensor) else dict(item)
        given = batch.get("input_ids")
        if not isinstance(given, torch.Tensor) or given.dim() != 2 or given.shape[0] * given.shape[1] < 2:
            raise ValueError("calibrate: each batch needs input_ids of shape [batch, seq] holding at least 2 tokens, "
                             f"got {tuple(given.shape) if isinstance(given, torch.Tensor) else type(given).__name__}")
        check_token_ids(given, vocabulary_size(model))
        if batch.get("attention_mask") is not None:
            check_attention_mask(batch["attention_mask"], given)
        out.append({k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")})
    if not out:
        raise ValueError("calibrate: no batches given")
    return out


def vocabulary_size(model: Any) -> int:
    """How many token ids the model's input embedding holds."""
    return int(model.get_input_embeddings().weight.shape[0])


def check_token_ids(ids: torch.Tensor, vocabulary: int) -> None:
    """Token ids the model can embed, or one error naming what is wrong: integer ids (torch.long or torch.int, as
    the embedding takes them; else a TypeError) in [0, vocabulary) (else a ValueError naming the ids out of it)."""
    accepted = f"integer token ids (torch.long or torch.int) in [0, {vocabulary}), the model's vocabulary"
    if ids.dtype not in (torch.long, torch.int):
        raise TypeError(f"calibrate: input_ids hold {ids.dtype} values; give {accepted}")
    bad = ((ids < 0) | (ids >= vocabulary)).nonzero()
    if len(bad):
        shown = ", ".join(f"{int(ids[tuple(at)])} at {tuple(int(i) for i in at)}" for at in bad[:5])
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise ValueError(f"calibrate: input_ids hold {len(bad)} id(s) outside the vocabulary ({shown}{more}); "
                         f"give {accepted}")


def check_attention_mask(mask: Any, ids: torch.Tensor) -> None:
    """An attention mask the model can read with these token ids, or one error naming what is wrong: a tensor of
    their shape holding 0 and 1 (a TypeError for another type, a ValueError for another shape or other values)."""
    accepted = f"a tensor of the input_ids' shape {tuple(ids.shape)} holding 1 (attend) and 0 (padding)"
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"calibrate: attention_mask is {type(mask).__name__}; give {accepted}")
    if mask.shape != ids.shape:
        raise ValueError(f"calibrate: attention_mask has shape {tuple(mask.shape)}; give {accepted}")
    if mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"calibrate: attention_mask holds values other than 0 and 1; give {accepted}")


@torch.no_grad()
def fresh_statistics_problem(model: PreTrainedModel) -> str | None:
    """Why the model, just given BatchNorms with fresh running statistics, cannot be used in eval() as it is: its
    logits on a probe batch are not finite (None: they are)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        out = model(**model_batches(model, None)[0])
    except Exception:  # a model that does not run on token ids alone (an encoder-decoder, ...): nothing to tell
        return None
    finally:
        restore_modes(modes)
    found = out.logits if getattr(out, "logits", None) is not None else out[0]
    if not isinstance(found, torch.Tensor) or bool(torch.isfinite(found).all()):
        return None
    return ("norm='batchnorm': with fresh running statistics (mean 0, variance 1) the model's logits in eval() are "
            "not finite on a probe batch: the running statistics normalise nothing. Calibrate them before "
            "evaluating (hfpatch.calibrate(model, batches): running statistics from your text, or from a probe "
            "batch) or train the model first")
