"""placement=...: where each block's norms sit. The registry `PLACEMENTS` holds one record per value:

    pre:   h = h + Attn(N1(h));  h = h + MLP(N2(h))              (GPT-2 onwards)
    post:  h = N1(h + Attn(h));  h = N2(h + MLP(h))              (the original Transformer)
    peri:  h = h + O1(Attn(N1(h)));  h = h + O2(MLP(N2(h)))      (Peri-LN, Kim et al. 2025: new output norms O1, O2)
    mix:   post in the first blocks, pre in the rest             (Mix-LN, Li et al. 2025; option post_fraction)

The block keeps its modules and parameters; only its forward changes, by giving the instance a subclass whose
forward is the other placement (`Edits.mix_in`). Swapping the class, not `layer.forward`, keeps transformers'
gradient checkpointing, which wraps the class's forward. The forms are written once over the adapter's paths
(adapters/blocks.py) and apply to every family whose blocks inference verified against them; BERT, whose norms sit
inside its attention.output / output modules, has its own pre-norm form here.

The final norm of the decoder families stays where it is. Pre-norm BERT gets no final norm of its own. A parallel
block (GPT-NeoX: attention and MLP read the same input) has no post-norm form with two norms, so its post form runs
attention, then MLP, sequentially; its peri form stays parallel, with an output norm on each branch.

Peri-LN's output norms are new modules of the block's own norm kind (same eps and scale form), with a unit scale
and a zero bias: the form a model trained from scratch starts from. On a pretrained model, hfpatch.calibrate fits
their scale and bias so that each reproduces the sublayer output it normalises (norm/fit.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..adapters import Adapter, get_path
from ..adapters.blocks import SPEC_ATTR, BlockSpec, GenericBlock
from ..edits import Edits
from ..registry import Registry
from .kinds import NORMS
from .modules import NormModule, build, read

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class PreNormBertBlock:
    """BERT's norms live inside attention.output and output (after dense + dropout + residual); pre-norm applies
    them to the block input instead and adds the sublayer outputs to the raw stream."""

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                past_key_values=None, **kwargs):
        if encoder_hidden_states is not None:
            raise ValueError("hfpatch placement='pre' on bert does not support cross-attention")
        att = self.attention
        a, _ = att.self(att.output.LayerNorm(hidden_states), attention_mask=attention_mask,
                        past_key_values=past_key_values, **kwargs)
        hidden_states = hidden_states + att.output.dropout(att.output.dense(a))
        out = self.output
        ff = out.dropout(out.dense(self.intermediate(out.LayerNorm(hidden_states))))
        return hidden_states + ff


def _fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(f"post_fraction must be a number with 0 < post_fraction < 1 (the fraction of the blocks, from "
                         f"the first, that become post-norm; the Mix-LN paper uses 0.25); got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Placement:
    summary: str
    layouts: tuple[str, ...]  # the adapters' placement layouts it applies to ("generic": the forms of blocks.py)
    options: dict[str, Callable] = field(default_factory=dict)  # {name: validator -> the value to store}
    defaults: dict = field(default_factory=dict)  # the value an option left out takes
    changes_weights: bool = False  # it adds parameters (reloads by loading into the patched structure)


PLACEMENTS: Registry[Placement] = Registry.of("placement", {  # what patch(placement=...) accepts
    "pre": Placement("each sublayer reads a norm of the stream: h = h + F(N(h))", ("generic", "bert")),
    "post": Placement("a norm after each residual add: h = N(h + F(h))", ("generic", "bert")),
    "peri": Placement("a norm on each sublayer's input and on its output: h = h + N_out(F(N_in(h)))",
                      ("generic",), changes_weights=True),
    "mix": Placement("post-norm in the first post_fraction of the blocks, pre-norm in the rest",
                     ("generic", "bert"), options={"post_fraction": _fraction}, defaults={"post_fraction": 0.25}),
})

# The peri forms' output norms, as attributes of each block (after attention, after the MLP)
OUTPUT_NORMS = ("hfpatch_attention_output_norm", "hfpatch_mlp_output_norm")


def placement_forms(adapter: Adapter) -> list[str]:
    """The placements `patch(placement=...)` accepts for this adapter (its own included); [] where the blocks have
    no known pre/post form."""
    own = adapter.placement if isinstance(adapter.placement, str) else None
    if adapter.placement_layout is not None:
        return [name for name, rec in PLACEMENTS.items() if adapter.placement_layout in rec.layouts]
    return [own] if own else []


def post_layers(n: int, fraction: float) -> int:
    """How many blocks, from the first, Mix-LN makes post-norm: floor(fraction · n), at least 1 and at most n - 1
    (so that both forms are there)."""
    if n < 2:
        raise ValueError(f"placement='mix' needs at least 2 blocks (one post-norm, one pre-norm); the model has {n}")
    return min(n - 1, max(1, math.floor(fraction * n + 1e-9)))


def layer_forms(req: dict, n: int) -> list[str]:
    """The placement of each of `n` blocks under the request `req`."""
    rec = PLACEMENTS[req["kind"]]
    if "post_fraction" in rec.options:
        k = post_layers(n, req.get("post_fraction", rec.defaults["post_fraction"]))
        return ["post"] * k + ["pre"] * (n - k)
    return [req["kind"]] * n


def apply_placement(model: PreTrainedModel, adapter: Adapter, req: dict, edits: Edits) -> dict:
    want, have = req["kind"], adapter.placement_of(model.config)
    carried = carried_forms(model, adapter)
    if want == have and not any(carried):
        return {}
    forms = placement_forms(adapter)
    if want not in forms and len(forms) > 1:
        raise ValueError(f"placement={want!r} is not available for {adapter.model_type}: its blocks have the forms "
                         f"{', '.join(repr(f) for f in forms)} only")
    if want not in forms:
        why = adapter.notes.get("placement")
        raise ValueError(f"placement={want!r} is not available for {adapter.model_type} (its blocks use {have!r} "
                         f"norms{': ' + why if why else ''}); placement applies to blocks with a known pre/post form")
    if getattr(model.config, "add_cross_attention", False):
        raise ValueError(f"placement={want!r} does not support models with cross-attention")
    layers = get_path(model.base_model, adapter.layers)
    forms = layer_forms(req, len(layers))
    for layer, form, now in zip(layers, forms, carried):
        if form == (now or have):  # a block already in this form keeps its forward (a parallel block's pre form)
            continue
        if now:  # the form a reloaded checkpoint was built with gives way: the block's own forward first
            _own_form(layer, edits)
        if form == have:
            continue
        if adapter.placement_layout == "bert":
            edits.mix_in(layer, PreNormBertBlock)
            continue
        # a parallel block's post form is the sequential one; its peri form stays parallel
        outputs = None
        if form == "peri":
            outputs = _add_output_norms(layer, adapter, edits)
            form = "parallel_peri" if adapter.parallel else "peri"
        spec = BlockSpec(form, adapter.attention, adapter.mlp, tuple(adapter.norms),
                         tuple(adapter.residual_dropouts), outputs)
        edits.set(layer, SPEC_ATTR, spec)
        edits.mix_in(layer, GenericBlock)
    return {"layers": forms} if len(set(forms)) > 1 else {}


def carried_forms(model: PreTrainedModel, adapter: Adapter) -> list[str | None]:
    """The placement each block carries already, None for its family's own forward. Only a model reloaded with a
    weight-changing placement (peri: its output norms are in the checkpoint) has blocks in another form when a
    placement is applied, since a live placement is undone first."""
    if adapter.placement_layout is None:
        return []
    return [_carried_form(layer) for layer in get_path(model.base_model, adapter.layers)]


def _carried_form(layer: nn.Module) -> str | None:
    if isinstance(layer, PreNormBertBlock):
        return "pre"
    if isinstance(layer, GenericBlock):
        form = getattr(layer, SPEC_ATTR).placement
        return "peri" if form == "parallel_peri" else form
    return None


def _own_form(layer: nn.Module, edits: Edits) -> None:
    """Give a block in another placement form its family's own forward back: its class, without the form's spec
    and output norms (undoing `edits` gives them back)."""
    edits.unmix(layer, PreNormBertBlock if isinstance(layer, PreNormBertBlock) else GenericBlock)
    for name in (SPEC_ATTR, *OUTPUT_NORMS):
        edits.delete(layer, name)


def _add_output_norms(layer: nn.Module, adapter: Adapter, edits: Edits) -> tuple[str, str]:
    """Give the block its two Peri-LN output norms, each of the kind of the block's first norm, unit scale."""
    source = get_path(layer, adapter.norms[0])
    for name in OUTPUT_NORMS:
        edits.set(layer, name, _unit_norm(source, adapter))
    return OUTPUT_NORMS


@torch.no_grad()
def _unit_norm(source: nn.Module, adapter: Adapter) -> NormModule:
    """A new norm like `source` (its kind, shape, eps, scale form, dtype, device), with a unit scale and a zero bias
    where `source` has a weight / bias: the identity's nearest norm."""
    if isinstance(source, NormModule):
        return source.sibling()
    p = read(source, adapter.norm_classes)
    like = p.weight if p.weight is not None else next(iter(source.parameters()), torch.zeros(()))
    shape = tuple(p.weight.shape) if p.weight is not None else tuple(getattr(source, "normalized_shape", ()))
    unit = None if p.weight is None else torch.full(shape, 1.0 - p.offset)
    bias = None if p.bias is None else torch.zeros(shape)
    return build(NORMS[p.kind].module, shape, p.eps, p.offset, unit, bias, like).train(source.training)
