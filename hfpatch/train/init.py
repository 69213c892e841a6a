"""How a model built from a config (recipes/pretrain.py: `init:`) gets its first weights.

- "hf": transformers' own initialisation, as `from_config` leaves it. For Llama (and most decoders) that is
  PreTrainedModel._init_weights: every linear weight and the embedding drawn from N(0, initializer_range = 0.02),
  the padding row of the embedding zeroed, biases 0, norm weights 1; the embedding output enters the first block
  unscaled. A residual stream that starts at RMS ~0.02 is what the blocks see first.
- "paper": the Transformer's conditions as in Vaswani et al. 2017 and Xiong et al. 2020 ("On Layer Normalization in
  the Transformer Architecture"): linear weights Xavier (Glorot) uniform, std sqrt(2 / (fan_in + fan_out)), biases 0;
  the embedding drawn from N(0, d^-1/2) (its padding row zeroed) and its output multiplied by sqrt(d) at the input,
  so the stream starts at RMS ~1; a tied output head reads the unscaled table. The optimizer's beta2 = 0.98 of
  those papers is the separate key `adam_beta2`.

The embedding scale is a forward-time multiplier (a subclass of the embedding module, `ScaledEmbedding`). A model
saved and loaded again by transformers does not carry it: `config.hfpatch_embedding_scale` records it in
config.json, and `restore(model)` puts it back after loading.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn
from transformers import PreTrainedModel

from ..edits import Edits
from ..registry import Registry

SCALE_CONFIG_KEY = "hfpatch_embedding_scale"  # in the model's config: the factor a loaded model must get back


class ScaledEmbedding:
    """Mixed into the input embedding: its output times `hfpatch_embedding_scale` (the table itself is unchanged,
    so a tied output head still reads the unscaled weights)."""

    hfpatch_embedding_scale: float = 1.0

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs) * self.hfpatch_embedding_scale


def xavier_linears(model: PreTrainedModel) -> int:
    """Every nn.Linear weight Xavier-uniform (std sqrt(2 / (fan_in + fan_out))), its bias 0; returns how many. A
    tied output head shares the embedding's tensor and is left to the embedding's init."""
    tied = model.get_input_embeddings().weight
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight is not tied:
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
            count += 1
    return count


def scaled_embedding(model: PreTrainedModel, edits: Edits | None = None) -> float:
    """The embedding redrawn from N(0, d^-1/2) (padding row 0) and its output multiplied by sqrt(d): the embedded
    tokens start at RMS ~1. Returns the factor sqrt(d)."""
    weight = cast(torch.Tensor, model.get_input_embeddings().weight)
    pad = getattr(model.get_input_embeddings(), "padding_idx", None)
    d = weight.shape[-1]
    with torch.no_grad():
        nn.init.normal_(weight, mean=0.0, std=d ** -0.5)
        if pad is not None:
            weight[pad].zero_()
    factor = math.sqrt(d)
    set_embedding_scale(model, factor, edits)
    return factor


def set_embedding_scale(model: PreTrainedModel, factor: float, edits: Edits | None = None) -> None:
    """Multiply the input embedding's output by `factor` (recorded in the config, so a saved model says so)."""
    edits = edits if edits is not None else Edits()
    emb = model.get_input_embeddings()
    if not isinstance(emb, ScaledEmbedding):
        edits.mix_in(emb, ScaledEmbedding)
    edits.set(emb, "hfpatch_embedding_scale", float(factor))
    setattr(model.config, SCALE_CONFIG_KEY, float(factor))


def restore(model: PreTrainedModel) -> PreTrainedModel:
    """After loading a model trained with init="paper": its embedding scale back from its config (no-op otherwise)."""
    factor = getattr(model.config, SCALE_CONFIG_KEY, None)
    if factor is not None:
        set_embedding_scale(model, factor)
    return model


def hf(model: PreTrainedModel) -> None:
    """transformers' initialisation: what from_config already drew."""


def paper(model: PreTrainedModel) -> None:
    """Xiong et al. 2020's conditions (the optimizer's beta2 aside): scaled embedding, Xavier linears."""
    scaled_embedding(model)  # first: the RNG draws the embedding, then the linears in module order
    xavier_linears(model)


INITS = Registry.of("initialisation", {"hf": hf, "paper": paper})  # what the `init:` key accepts


def apply(model: PreTrainedModel, init: str) -> PreTrainedModel:
    """Initialise `model` (freshly built, weights drawn as the RNG was seeded) the way `init` names."""
    if init not in INITS:
        raise ValueError(f"init must be one of {', '.join(INITS)}; got {init!r}")
    INITS[init](model)
    return model
