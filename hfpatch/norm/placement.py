"""placement="post" | "pre": move each block's norms after the residual add (the original Transformer) or before
the sublayer (GPT-2 onwards).

The block keeps its modules and parameters; only its forward changes, by giving the instance a subclass whose
forward is the other placement (`Edits.swap_class`). Swapping the class, not `layer.forward`, keeps transformers'
gradient checkpointing, which wraps the class's forward.

    pre:  h = h + Attn(N1(h));  h = h + MLP(N2(h))
    post: h = N1(h + Attn(h));  h = N2(h + MLP(h))

The final norm of the decoder families stays where it is. Pre-norm BERT gets no final norm of its own.
"""

from __future__ import annotations

from ..adapters import Adapter, get_path
from ..edits import Edits


def _drop(layer, name, x):
    dropout = getattr(layer, name, None)
    return x if dropout is None else dropout(x)


class PostNormLlamaBlock:
    """Llama-style blocks (llama, mistral, qwen2, qwen3, gemma, phi3): input_layernorm, self_attn,
    post_attention_layernorm, mlp; phi3's residual dropouts kept."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs):
        attn, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                 position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache,
                                 position_embeddings=position_embeddings, **kwargs)
        hidden_states = self.input_layernorm(hidden_states + _drop(self, "resid_attn_dropout", attn))
        mlp = self.mlp(hidden_states)
        return self.post_attention_layernorm(hidden_states + _drop(self, "resid_mlp_dropout", mlp))


class PostNormGPT2Block:
    def forward(self, hidden_states, past_key_values=None, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, use_cache=False, **kwargs):
        if encoder_hidden_states is not None:
            raise ValueError("hfpatch placement='post' on gpt2 does not support cross-attention")
        attn, _ = self.attn(hidden_states, past_key_values=past_key_values, attention_mask=attention_mask,
                            use_cache=use_cache, **kwargs)
        hidden_states = self.ln_1(hidden_states + attn)
        return self.ln_2(hidden_states + self.mlp(hidden_states))


class PostNormGPTNeoXBlock:
    """Sequential post-norm: the parallel residual (attention and MLP reading the same input) has no post-norm
    form with two norms, so the post-norm block runs attention, then MLP, like the original Transformer."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, use_cache=False, layer_past=None,
                position_embeddings=None, **kwargs):
        attn, _ = self.attention(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                 layer_past=layer_past, use_cache=use_cache, position_embeddings=position_embeddings,
                                 **kwargs)
        hidden_states = self.input_layernorm(hidden_states + self.post_attention_dropout(attn))
        mlp = self.post_mlp_dropout(self.mlp(hidden_states))
        return self.post_attention_layernorm(hidden_states + mlp)


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


# (layout, placement wanted) -> the mixin; the family's own forward is the other placement.
MIXINS = {
    ("llama", "post"): PostNormLlamaBlock,
    ("gpt2", "post"): PostNormGPT2Block,
    ("gpt_neox", "post"): PostNormGPTNeoXBlock,
    ("bert", "pre"): PreNormBertBlock,
}


def apply_placement(model, adapter: Adapter, req: dict, edits: Edits) -> dict:
    want, have = req["kind"], adapter.placement_of(model.config)
    if want == have:
        return {}
    mixin = MIXINS.get((adapter.placement_layout, want))
    if mixin is None:
        movable = sorted({"llama": "llama, mistral, qwen2, qwen3, gemma, phi3", "gpt2": "gpt2", "gpt_neox": "gpt_neox",
                          "bert": "bert"}.values())
        raise ValueError(f"placement={want!r} is not available for {adapter.model_type} (its blocks use {have!r} norms); "
                         f"placement applies to: {', '.join(movable)}")
    if getattr(model.config, "add_cross_attention", False):
        raise ValueError(f"placement={want!r} does not support models with cross-attention")
    for layer in get_path(model.base_model, adapter.layers):
        edits.mix_in(layer, mixin)
    return {}
