"""What hfpatch needs to know about one model family, as plain data.

Paths are dotted attribute paths. `layers`, `rotaries`, `position_table`, `final_norm` and `embedding_norm` are
relative to the *base* model (`model.base_model`, e.g. `LlamaModel` inside `LlamaForCausalLM`); `attention`, `mlp`
and `norms` are relative to one entry of `layers`. Adapters are read off the live model (adapters/infer/); the few
fields inference cannot see are overridden by hand (adapters/__init__.OVERRIDES).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


def get_path(root: nn.Module, path: str | None) -> Any:
    """root.a.b.c for path "a.b.c" (list indices are attributes of nn.ModuleList too). `path` is typed as the
    adapter's optional fields are: the patches that read a field require it first (their Requirement records), so
    None here is a bug, reported as the missing attribute it is."""
    if path is None:
        raise AttributeError(f"{type(root).__name__}: no module path (the adapter found none)")
    for part in path.split("."):
        root = getattr(root, part)
    return root


def class_key(module: nn.Module) -> str:
    """"module.Class" of a module: how Adapter.norm_classes names the family's own norm classes."""
    t = type(module)
    return f"{t.__module__}.{t.__qualname__}"


@dataclass(frozen=True)
class NormClass:
    """What one class of norm module computes, read numerically (adapters.infer.classify_norm)."""

    kind: str  # "rmsnorm" | "layernorm"
    offset: float  # the scale is offset + weight (Gemma: 1)
    eps: float
    eps_attr: str | None = None  # the attribute the module keeps eps in (None: eps was matched from the config)
    upcast: str | None = None  # in bfloat16: "fp32" | "normalize" (scale in the input dtype) | "none" | None unknown


@dataclass(frozen=True)
class Adapter:
    model_type: str
    layers: str | None  # the list of transformer blocks (None: not found; only RoPE rescaling applies)
    attention: str | None  # the attention module inside a block (None: none found)
    norms: tuple[str, ...]  # the norms inside a block, in forward order
    mlp: str | None = None  # the feed-forward module inside a block (None: its linears sit in the block itself)
    final_norm: str | None = None
    embedding_norm: str | None = None  # BERT normalizes the embeddings
    head_norms: tuple[str, ...] = ()  # norms in task heads, relative to the *top* model (skipped when absent)
    qk_norms: tuple[str, ...] = ()  # per-head norms on queries/keys (qwen3, gemma3, olmo2), relative to a block
    norm: str = "rmsnorm"  # "rmsnorm" | "layernorm" | "mixed" | "none"
    norm_offset: float = 0.0  # Gemma's norms scale by 1 + weight
    # "pre": x + f(norm(x)); "post": norm(x + f(x)); "sandwich": pre and post norms around each sublayer (gemma2/3);
    # "post_sublayer": x + norm(f(x)) (olmo2); None: unknown. A callable reads it from the config (OPT can be either).
    placement: str | Callable | None = "pre"
    parallel: bool = False  # attention and MLP both read the block input: x + attn(n1(x)) + mlp(n2(x)) (gpt-neox)
    # The residual stream, for the exact LayerNorm -> RMSNorm conversion (empty: no exact conversion):
    residual_readers: dict = field(default_factory=dict)  # block norm -> the linears it feeds (block-relative)
    residual_writers: tuple[str, ...] = ()  # linears whose output is added to the stream (block-relative)
    # modules whose outputs start the stream (base-relative); "a|b": a if the model has it (not None), else b
    embedding_writers: tuple[str, ...] = ()
    # what reads the final norm, if not the LM head (base-relative, first one present wins)
    final_readers: tuple[str, ...] = ()
    # Which pre/post block forms apply: "generic" (adapters/blocks.py, verified on the model), "bert"; None: none
    placement_layout: str | None = None
    residual_dropouts: tuple = (None, None)  # dropouts on the attention / MLP output before the residual add
    rotaries: tuple[str, ...] = ()  # the rotary modules (base-relative); empty = the family has no RoPE
    position_table: str | None = None  # learned absolute position embeddings
    position_offset: int = 0  # rows before position 0 in that table (OPT: 2)
    causal: bool = True
    attention_layers: tuple[int, ...] | None = None  # blocks that have `attention` (hybrid stacks); None: all
    attention_interface: bool = True  # attention runs through transformers' AttentionInterface
    window: int | None = None  # the trained context the config names (None: it names none)
    heads: tuple[int, ...] = ()  # query heads of the attention module of each attention layer
    norm_classes: dict = field(default_factory=dict)  # "module.Class" -> NormClass, for the family's own norms
    source: str = "inferred"  # "inferred + overrides" where adapters/__init__.OVERRIDES adds fields
    notes: dict = field(default_factory=dict)  # what could not be read, and so does not apply: {topic: reason}

    @property
    def rotary(self) -> str | None:
        return self.rotaries[0] if self.rotaries else None

    @property
    def has_rope(self) -> bool:
        return bool(self.rotaries)

    def placement_of(self, config: PreTrainedConfig) -> str | None:
        return self.placement(config) if callable(self.placement) else self.placement

    @property
    def position_signal(self) -> str:
        """"rope" | "learned" | "none" | "unknown" (the config has RoPE but no rotary module was found)."""
        if self.rotaries:
            return "rope"
        if self.position_table is not None:
            return "learned"
        return "unknown" if "positions" in self.notes else "none"

    def to_dict(self, config: PreTrainedConfig) -> dict:
        """Plain JSON data (the placement evaluated for `config`): saved in the hfpatch record, so that a reload
        can rebuild the patched structure before the model has weights to probe."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "placement":
                v = self.placement_of(config)
            elif f.name == "norm_classes":
                v = {k: asdict(c) for k, c in v.items()}
            elif isinstance(v, tuple):
                v = list(v)
            elif isinstance(v, dict):
                v = {k: list(x) if isinstance(x, tuple) else x for k, x in v.items()}
            out[f.name] = v
        return out

    @classmethod
    def from_dict(cls, data: dict) -> Adapter:
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in data.items() if k in known}
        for k, v in kw.items():
            if isinstance(v, list):
                kw[k] = tuple(v)
        kw["norm_classes"] = {k: NormClass(**c) for k, c in kw.get("norm_classes", {}).items()}
        kw["residual_readers"] = {k: tuple(v) for k, v in kw.get("residual_readers", {}).items()}
        return cls(**kw)
