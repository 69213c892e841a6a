"""placement="post" | "pre": move each block's norms after the residual add (the original Transformer) or before
the sublayer (GPT-2 onwards).

The block keeps its modules and parameters; only its forward changes, by giving the instance a subclass whose
forward is the other placement (`Edits.mix_in`). Swapping the class, not `layer.forward`, keeps transformers'
gradient checkpointing, which wraps the class's forward. The forms are written once over the adapter's paths
(adapters/blocks.py) and apply to every family whose blocks inference verified against them; BERT, whose norms sit
inside its attention.output / output modules, has its own pre-norm form here.

    pre:  h = h + Attn(N1(h));  h = h + MLP(N2(h))
    post: h = N1(h + Attn(h));  h = N2(h + MLP(h))

The final norm of the decoder families stays where it is. Pre-norm BERT gets no final norm of its own. A parallel
block (GPT-NeoX: attention and MLP read the same input) has no post-norm form with two norms, so its post form runs
attention, then MLP, sequentially.
"""

from __future__ import annotations

from ..adapters import Adapter, get_path
from ..adapters.blocks import SPEC_ATTR, BlockSpec, GenericBlock
from ..edits import Edits


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


PLACEMENTS = ("pre", "post")  # what patch(placement=...) accepts


def placement_forms(adapter: Adapter) -> list[str]:
    """The placements `patch(placement=...)` accepts for this adapter (its own included); [] where the blocks have
    no known pre/post form."""
    own = adapter.placement if isinstance(adapter.placement, str) else None
    if adapter.placement_layout == "bert":
        return ["post", "pre"]
    if adapter.placement_layout == "generic":
        return ["post", "pre"]
    return [own] if own else []


def apply_placement(model, adapter: Adapter, req: dict, edits: Edits) -> dict:
    want, have = req["kind"], adapter.placement_of(model.config)
    if want == have:
        return {}
    if want not in placement_forms(adapter):
        why = adapter.notes.get("placement")
        raise ValueError(f"placement={want!r} is not available for {adapter.model_type} (its blocks use {have!r} "
                         f"norms{': ' + why if why else ''}); placement applies to blocks with a known pre/post form")
    if getattr(model.config, "add_cross_attention", False):
        raise ValueError(f"placement={want!r} does not support models with cross-attention")
    layers = get_path(model.base_model, adapter.layers)
    if adapter.placement_layout == "bert":
        for layer in layers:
            edits.mix_in(layer, PreNormBertBlock)
        return {}
    # a parallel block's post form is the sequential one; its pre form is its own
    spec = BlockSpec(want, adapter.attention, adapter.mlp, tuple(adapter.norms), tuple(adapter.residual_dropouts))
    for layer in layers:
        edits.set(layer, SPEC_ATTR, spec)
        edits.mix_in(layer, GenericBlock)
    return {}
