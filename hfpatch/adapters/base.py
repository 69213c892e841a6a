"""What hfpatch needs to know about one model family, as plain data.

Paths are dotted attribute paths. `layers`, `rotary`, `position_table`, `final_norm` and `embedding_norm` are
relative to the *base* model (`model.base_model`, e.g. `LlamaModel` inside `LlamaForCausalLM`); `attention` and
`norms` are relative to one entry of `layers`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


def get_path(root, path: str):
    """root.a.b.c for path "a.b.c" (list indices are attributes of nn.ModuleList too)."""
    for part in path.split("."):
        root = getattr(root, part)
    return root


@dataclass(frozen=True)
class Adapter:
    model_type: str
    layers: str  # the list of transformer blocks
    attention: str  # the attention module inside a block
    norms: tuple[str, ...]  # the norms inside a block, in forward order
    mlp: str | None = None  # the feed-forward module inside a block (None: its linears sit in the block itself)
    final_norm: str | None = None
    embedding_norm: str | None = None  # BERT normalizes the embeddings
    head_norms: tuple[str, ...] = ()  # norms in task heads, relative to the *top* model (skipped when absent)
    qk_norms: tuple[str, ...] = ()  # per-head norms on queries/keys (qwen3, gemma3, olmo2), relative to a block
    norm: str = "rmsnorm"  # "rmsnorm" | "layernorm"
    norm_offset: float = 0.0  # Gemma's norms scale by 1 + weight
    # "pre": x + f(norm(x)); "post": norm(x + f(x)); "sandwich": pre and post norms around each sublayer (gemma2/3);
    # "post_sublayer": x + norm(f(x)) (olmo2). A callable reads it from the config (OPT can be either).
    placement: str | Callable = "pre"
    # The residual stream, for the exact LayerNorm -> RMSNorm conversion (empty: no exact conversion):
    residual_readers: dict = field(default_factory=dict)  # block norm -> the linears it feeds (block-relative)
    residual_writers: tuple[str, ...] = ()  # linears whose output is added to the stream (block-relative)
    # modules whose outputs start the stream (base-relative); "a|b": a if the model has it (not None), else b
    embedding_writers: tuple[str, ...] = ()
    # what reads the final norm, if not the LM head (base-relative, first one present wins)
    final_readers: tuple[str, ...] = ()
    # Which pre/post forward pair the blocks follow ("llama", "gpt2", "gpt_neox", "bert"); None: no placement swap
    placement_layout: str | None = None
    rotary: str | None = None  # the rotary module; None = the family has no RoPE
    position_table: str | None = None  # learned absolute position embeddings
    position_offset: int = 0  # rows before position 0 in that table (OPT: 2)
    causal: bool = True
    # RoPE types the family's config class accepts and round-trips through config.json (phi3: default/longrope).
    native_rope_types: frozenset = field(
        default_factory=lambda: frozenset({"default", "linear", "dynamic", "yarn", "llama3", "longrope"})
    )
    # Models whose config nests rope_parameters per layer type (gemma3): the types a scaling scheme applies to by
    # default. Transformers' own legacy `rope_scaling` goes to the global-attention layers only; so do we.
    rope_layer_types: tuple[str, ...] = ()

    @property
    def has_rope(self) -> bool:
        return self.rotary is not None

    def placement_of(self, config) -> str:
        return self.placement(config) if callable(self.placement) else self.placement

    def position_kind(self) -> str:
        if self.rotary is not None:
            return "rope"
        if self.position_table is not None:
            return "learned"
        return "none"


# The block layout of Llama and the families that copy it (mistral, qwen2, qwen3, gemma): two pre-norms, q/k/v/o
# projections, a gated MLP, one rotary module on the base model.
LLAMA_STYLE = dict(
    layers="layers",
    attention="self_attn",
    norms=("input_layernorm", "post_attention_layernorm"),
    mlp="mlp",
    final_norm="norm",
    residual_readers={
        "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
    },
    residual_writers=("self_attn.o_proj", "mlp.down_proj"),
    embedding_writers=("embed_tokens",),
    placement_layout="llama",
    rotary="rotary_emb",
)
