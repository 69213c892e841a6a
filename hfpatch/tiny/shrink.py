"""How a family's default config becomes a tiny one: general rules over attribute names (sizes, layer stacks, RoPE
windows), the same for every family; see the package's docstring for why.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from transformers import PreTrainedConfig

WINDOW = 64  # max_position_embeddings of every tiny model: the window it is "trained" for
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB = 64, 2, 4, 2, 16, 128, 128
SLIDING = 16  # sliding / local / chunked attention windows: below WINDOW, so the local path runs too
EXPERTS, TOP_K, EXPERT_INTERMEDIATE = 4, 2, 32



# --- sizes: what each name becomes -----------------------------------------------------------------------------------
def _at_most(n: int):
    return lambda old: min(old, n)


_SIZE_NAMES = (  # (tiny value, the names families give that size)
    (HIDDEN, ("hidden_size", "n_embd", "d_model", "embedding_dim", "emb_dim", "dim_model", "hidden_size_global",
              "lru_width", "attention_hidden_size",
              "shape_embed_dim")),
    (HEADS, ("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
             "encoder_attention_heads", "attention_heads", "num_decoder_attention_heads", "num_encoder_attention_heads",
             "swa_num_attention_heads", "linear_num_heads", "index_n_heads", "indexer_n_heads",
             "linear_num_value_heads")),
    (KV_HEADS, _KV_HEAD_NAMES := ("num_key_value_heads", "num_kv_heads", "kv_n_heads", "n_kv_heads",
                                  "swa_num_key_value_heads", "num_query_groups", "linear_num_key_heads")),
    (HEAD_DIM, ("head_dim", "d_head", "attention_head_dim", "attention_head_size", "dim_head", "kv_channels",
                "swa_head_dim", "linear_head_dim", "index_head_dim", "indexer_head_dim",
                "linear_key_head_dim", "linear_value_head_dim",
                "mamba_d_head", "mamba_head_dim", "mamba_headdim")),
    (INTERMEDIATE, ("intermediate_size", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "n_inner", "dff", "dim_ff",
                    "d_inner", "ffn_hidden_size", "feed_forward_size", "intermediate_size_mlp",
                    "dense_intermediate_size", "mlp_dim")),
    (EXPERT_INTERMEDIATE, ("moe_intermediate_size", "expert_ffn_hidden_size", "shared_expert_intermediate_size",
                           "shared_experts_intermediate_size", "moe_shared_expert_intermediate_size")),
    (EXPERTS, ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")),
    (VOCAB, ("vocab_size", "unpadded_vocab_size", "vocab_size_per_layer_input", "encoder_hash_byte_group_vocab",
             "shape_vocab_size", "pronunciation_vocab_size")),
    (WINDOW, ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_target_positions",
              "context_length", "original_max_position_embeddings")),
    (SLIDING, ("sliding_window", "sliding_window_size", "attention_window_size", "local_attention",
               "attention_chunk_size", "local_attention_window_len")),
    # MLA: the q / kv / o low ranks, and a query/key head of HEAD_DIM split into rotated and not rotated parts
    (32, ("q_lora_rank", "kv_lora_rank", "o_lora_rank")),
    (HEAD_DIM // 2, ("qk_rope_head_dim", "qk_nope_head_dim")),
    (HEAD_DIM, ("v_head_dim", "qk_head_dim")),
    # Mamba / linear attention: state 16, heads of HEAD_DIM channels filling expand (2) x HIDDEN
    (16, ("mamba_d_state", "state_size", "ssm_state_size", "chunk_size", "mamba_chunk_size",
          "hidden_size_per_layer_input")),
    (2 * HIDDEN, ("mamba_d_ssm",)),
    (2 * HIDDEN // HEAD_DIM, ("mamba_n_heads", "mamba_num_heads")),
    (8, ("time_step_rank", "mamba_dt_rank", "laurel_rank")),
)
_SIZE_RULES = {name: value for value, names in _SIZE_NAMES for name in names}
_SIZE_RULES.update({name: _at_most(TOP_K) for name in ("num_experts_per_tok", "num_experts_per_token", "moe_top_k",
                                                        "moe_topk", "moe_k")})
_SIZE_RULES.update({name: _at_most(1) for name in ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts",
                                                    "topk_group", "mamba_n_groups", "n_groups", "mamba_ngroups")})
_SIZE_RULES.update({name: _at_most(2) for name in ("n_group", "num_expert_group",  # groups of the 4 experts
                                                    "zero_expert_num")})  # identity experts besides the 4
_SIZE_RULES["shared_intermediate_size"] = _at_most(EXPERT_INTERMEDIATE)  # 0 (no shared expert) stays 0

# Sizes that families declare with default None meaning "hidden_size / heads" and "as many as the heads": they get
# their tiny value unless __post_init__ derived something else (deepseek's head_dim = qk_rope_head_dim).
_NAIVE = {"head_dim": lambda d: d.get("hidden_size", 0) // (d.get("num_attention_heads") or 1),
          "num_key_value_heads": lambda d: d.get("num_attention_heads")}
# Mamba heads x head size must equal expand x hidden: (heads, head size, expand) as families name them.
_MAMBA = (("num_heads", "head_dim", "expand"), ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
          ("mamba_num_heads", "mamba_head_dim", "mamba_expand"))
# Special-token ids must lie inside the tiny vocabulary: these where the default's is outside, others from the top.
_TOKEN_DEFAULTS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 2,
                   "forced_eos_token_id": 2}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_id(name: str) -> bool:
    return name.endswith(("_token_id", "_token_index", "_token_ids")) or name in _TOKEN_DEFAULTS


def _sizes(d: dict, declared: dict, widths: frozenset, changes: dict) -> None:
    """The size rules over the config's own declared fields. A field declared with default None is a feature that is
    off (q_lora_rank, sliding_window) or derived in __post_init__ from other sizes: it stays as it is, as do the
    attributes __post_init__ sets without declaring them (derived, so derived again from the tiny sizes). Other
    widths that equal the hidden size of this config or an enclosing one (adapter and projector widths) follow it."""
    for name, value in d.items():
        rule = _SIZE_RULES.get(name)
        if name not in declared:
            continue
        if rule is None:
            if _is_int(value) and value in widths and name.endswith(("_dim", "_size", "_channels", "_channel")) \
                    and not _is_token_id(name):
                changes[name] = HIDDEN
            continue
        if name in _NAIVE and declared[name] is None:
            if value is not None and value != _NAIVE[name](d):
                continue
        elif declared[name] is None or not (_is_int(value) or _is_int_list(value)):
            continue
        changes[name] = _apply(rule, value)
    if d.get("kv_lora_rank"):  # MLA decompresses keys and values per query head: no grouping
        changes.update({name: HEADS for name in _KV_HEAD_NAMES if name in changes})
    for heads, size, expand in _MAMBA:
        if all(_is_int(d.get(k)) for k in (heads, size, expand, "hidden_size")) and heads in changes \
                and d[heads] * d[size] == d[expand] * d["hidden_size"]:
            changes[heads] = d[expand] * HIDDEN // changes.get(size, d[size])
    if all(_is_int(d.get(k)) and k in changes for k in ("qk_rope_head_dim", "qk_nope_head_dim")):
        # an MLA query/key head of HEAD_DIM channels keeps the default's rotated fraction of the head: of head_dim
        # where that is the whole head (dots3 derives partial_rotary_factor = rope / head_dim), else of nope + rope
        rope, nope, head = d["qk_rope_head_dim"], d["qk_nope_head_dim"], d.get("head_dim")
        whole = head if _is_int(head) and head > rope else rope + nope
        changes.update(qk_rope_head_dim=_even(HEAD_DIM * rope / whole), qk_nope_head_dim=HEAD_DIM - _even(
            HEAD_DIM * rope / whole))
    changes.update(_mla_head_dim(d, {**d, **changes}, free=changes))
    if _is_int(d.get("rotary_dim")):  # gptj / codegen rotate rotary_dim channels: keep the rotated fraction
        n_heads, hidden = d.get("n_head") or d.get("num_attention_heads"), d.get("n_embd") or d.get("hidden_size")
        if n_heads and hidden:
            changes["rotary_dim"] = _even(d["rotary_dim"] / (hidden // n_heads) * HEAD_DIM)


def _even(x: float) -> int:
    """The nearest even number of channels, at least 2 (rotary channels come in pairs)."""
    return max(2, 2 * round(x / 2))


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and len(value) > 0 and all(_is_int(v) for v in value)


def _apply(rule: Any, value: Any) -> Any:
    """A size rule on one value, or on a per-layer list of them (gemma3n's intermediate_size per layer), keeping
    the list's proportions."""
    if isinstance(value, list):
        return [max(1, round(_apply(rule, max(value)) * v / max(value))) if v else 0 for v in value]
    return rule(value) if callable(rule) else rule


def _mla_head_dim(default: dict, tiny: dict, free: Any) -> dict:
    """MLA families tie head_dim to the rotated channels (head_dim = qk_rope_head_dim, the rotary size) or to the
    whole query/key head (head_dim = qk_nope_head_dim + qk_rope_head_dim): the tiny config keeps the relation the
    default has, changing head_dim, or else the not-rotated part, whichever of them is in `free`."""
    if not all(_is_int(default.get(k)) for k in ("head_dim", "qk_rope_head_dim", "qk_nope_head_dim")):
        return {}
    rope, nope = tiny["qk_rope_head_dim"], tiny["qk_nope_head_dim"]
    if default["head_dim"] == default["qk_rope_head_dim"] and "head_dim" in free:
        return {"head_dim": rope}
    if default["head_dim"] == default["qk_nope_head_dim"] + default["qk_rope_head_dim"]:
        if "head_dim" in free:
            return {"head_dim": nope + rope}
        if "qk_nope_head_dim" in free:
            return {"qk_nope_head_dim": tiny["head_dim"] - rope}
    return {}


def _token_ids(name: str, value: Any, taken: set) -> Any:
    if isinstance(value, list):
        return [_token_ids(name, v, taken) for v in value]
    if not _is_int(value) or 0 <= value < VOCAB:
        return value
    new = _TOKEN_DEFAULTS.get(name)
    if new is None:
        new = next(i for i in range(VOCAB - 1, -1, -1) if i not in taken)
    taken.add(new)
    return new


# --- layer stacks ----------------------------------------------------------------------------------------------------
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "num_decoder_layers",
                 "encoder_layers", "num_encoder_layers")
_INDEX_LIST_SUFFIXES = ("_layers", "_idxs", "_ids", "_indexes", "_indices")
# Counts that make the first k layers another kind (dense before MoE) or the last k (layers that reuse an earlier
# layer's keys and values): per layer a flag; after the cut, the number of kept layers with the flag.
_HEAD_COUNTS = ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index")
_TAIL_COUNTS = ("num_kv_shared_layers",)
# Scalars that place layer kinds periodically (where no explicit list does): 2, so that two layers hold both kinds.
_PERIODS = ("_period", "_interval", "_pattern", "_every_n_layers", "_step")


def _layer_count(d: dict) -> int | None:
    return next((d[name] for name in _LAYER_COUNTS if _is_int(d.get(name))), None)


def _sections(d: dict, declared: dict, n: int) -> list[str]:
    """Counts that cut the stack into consecutive sections (dory: n_input_layers, n_recurrent_layers,
    n_output_layers), in declaration order: integer fields named *_layers, other than the layer count, that add up
    to it. Empty where no such set exists."""
    names = [k for k in declared if k.endswith("_layers") and k not in _LAYER_COUNTS and _is_int(d.get(k))]
    return names if len(names) > 1 and sum(d[k] for k in names) == n else []


def _is_index_list(name: str, value: Any, n_layers: int) -> bool:
    return (name.endswith(_INDEX_LIST_SUFFIXES) and isinstance(value, list) and len(value) > 0
            and all(_is_int(v) for v in value) and all(a < b for a, b in itertools.pairwise(value))
            and value[-1] < n_layers)


def _layer_kinds(d: dict, n: int, changes: dict, sections: list[str]) -> dict:
    """What tells layer i from layer j, as one sequence over the layers per attribute: per-layer lists, lists of
    layer indices and head/tail counts (as flags), section counts (as the section's name), per_layer_config
    overrides."""
    kinds: dict[str, list] = {}
    if sections:
        kinds["__section__"] = [name for name in sections for _ in range(d[name])]
    for name in d:
        value = changes.get(name, d[name])  # a per-layer list of sizes comes shrunk already
        if (name in changes and not isinstance(value, list)) or _is_token_id(name):
            continue
        if _is_index_list(name, value, n):
            kinds[name] = [i in value for i in range(n)]
        elif isinstance(value, list) and len(value) == n and n > 1:
            kinds[name] = value
        elif name in _HEAD_COUNTS and _is_int(value):
            kinds[name] = [i < value for i in range(n)]
        elif name in _TAIL_COUNTS and _is_int(value):
            kinds[name] = [i >= n - value for i in range(n)]
    overrides = {int(k): v for k, v in (d.get("per_layer_config") or {}).items()}
    if overrides:
        kinds["per_layer_config"] = [overrides.get(i) for i in range(n)]
    return kinds


def _resize_layers(d: dict, declared: dict, changes: dict) -> None:
    """Keep the first layer of every distinct kind (at least LAYERS layers) and cut every per-layer attribute to the
    kept layers, in their original order."""
    n = _layer_count(d)
    if n is None:
        return
    sections = _sections(d, declared, n)
    kinds = _layer_kinds(d, n, changes, sections)
    first: dict[tuple[str, ...], int] = {}
    for i in range(n):
        first.setdefault(tuple(repr(seq[i]) for seq in kinds.values()), i)
    keep = sorted(first.values())
    keep = sorted(keep + [i for i in range(n) if i not in keep][: max(0, min(LAYERS, n) - len(keep))])
    for name in _LAYER_COUNTS:
        if _is_int(d.get(name)):
            changes[name] = len(keep)
    for name, seq in kinds.items():
        if name == "__section__":
            changes.update({section: sum(seq[i] == section for i in keep) for section in sections})
        elif name == "per_layer_config":
            changes[name] = {j: _scale_override(seq[i], d, changes) for j, i in enumerate(keep) if seq[i]}
        elif name in _HEAD_COUNTS or name in _TAIL_COUNTS:
            changes[name] = sum(seq[i] for i in keep)
        elif _is_index_list(name, d[name], n):
            changes[name] = [j for j, i in enumerate(keep) if seq[i]]
        else:
            changes[name] = [seq[i] for i in keep]
    for name, value in d.items():
        if name.endswith("types") and name not in kinds and isinstance(value, list) \
                and all(isinstance(v, str) for v in value) and len(set(value)) > 1:
            changes[name] = list(dict.fromkeys(value))  # a cyclic pattern of block kinds: one block of each
        elif name.endswith(_PERIODS) and _is_int(value) and value > 1:
            changes.setdefault(name, 2)
        elif name.endswith("_layer_offset") and _is_int(value):
            changes.setdefault(name, value % 2)


def _scale_override(override: dict, d: dict, changes: dict) -> dict:
    """A per-layer override of sizes (gemma4's wider full-attention heads) keeps its ratio to the global size; an
    MLA layer keeps its head relation."""
    out = dict(override)
    for name, value in override.items():
        if _is_int(value) and _is_int(d.get(name)) and _is_int(changes.get(name)) and d[name]:
            out[name] = max(1, round(changes[name] * value / d[name]))
    out.update(_mla_head_dim({**d, **override}, {**d, **changes, **out}, free=override))
    return out


# --- RoPE: the family's settings, only the window moves --------------------------------------------------------------
def _rope_params(params: dict, scale: float, rotary_half: Any) -> Any:
    """rope_parameters (flat, or one dict per layer type) with the window moved to WINDOW and M-RoPE sections
    (which split the rotated half-head between time / height / width) resized to the tiny rotary size."""
    if not isinstance(params, dict):
        return params
    if any(isinstance(v, dict) for v in params.values()):
        return {k: _rope_params(v, scale, rotary_half) for k, v in params.items()}
    out = dict(params)
    if out.get("original_max_position_embeddings"):
        out["original_max_position_embeddings"] = WINDOW
    if out.get("max_position_embeddings"):
        out["max_position_embeddings"] = round(WINDOW * scale)
    if isinstance(out.get("mrope_section"), list):
        out["mrope_section"] = _split(out["mrope_section"], int(rotary_half * out.get("partial_rotary_factor", 1.0)))
    return out


def _split(parts: list, total: int) -> list:
    """`parts` rescaled to sum to `total` (largest remainders)."""
    exact = [p * total / sum(parts) for p in parts]
    out = [int(x) for x in exact]
    for i in sorted(range(len(parts)), key=lambda i: exact[i] - out[i], reverse=True)[: total - sum(out)]:
        out[i] += 1
    return out


def _window(d: dict, changes: dict) -> None:
    """A natively scaled default (llama3 / yarn, original window < max) keeps its ratio: the trained window (the
    original) becomes WINDOW and the maximum WINDOW x ratio."""
    params = d.get("rope_parameters") or {}
    flat = [params] + [v for v in params.values() if isinstance(v, dict)]
    original = next((p["original_max_position_embeddings"] for p in flat if p.get("original_max_position_embeddings")),
                    None) or d.get("original_max_position_embeddings")
    current = d.get("max_position_embeddings")
    scale = current / original if original and current and current > original else 1.0
    if "max_position_embeddings" in changes:
        changes["max_position_embeddings"] = round(WINDOW * scale)
    if params:
        head_dim = changes.get("head_dim") or HIDDEN // HEADS
        # a partial rotation must turn an even number of channels (real heads do: 192 x 0.334 = 64); transformers'
        # YaRN ramp assumes it, so a tiny head of 16 x 0.334 = 5 channels would break the scheme, not the family
        factors = [p["partial_rotary_factor"] for p in flat if p.get("partial_rotary_factor")]
        if "head_dim" in changes and any(int(head_dim * f) % 2 for f in factors):
            wider = next(k * head_dim for k in range(2, 9) if not any(int(k * head_dim * f) % 2 for f in factors))
            changes["head_dim"] = head_dim = wider
        changes["rope_parameters"] = _rope_params(params, scale, head_dim // 2)


# --- one config ------------------------------------------------------------------------------------------------------
def shrink(config: PreTrainedConfig, widths: frozenset, given: dict) -> dict:
    """The keyword arguments that rebuild `config` (a family's default config) tiny; sub-configs as dicts. Fields
    in `given` (from _DEFAULTS) count as declared with that value, so the rules shrink them too."""
    d = _fields(config)
    declared = _declared(type(config))
    declared.update({k: v for k, v in given.items() if not isinstance(v, dict)})
    changes: dict = {}
    _sizes(d, declared, widths, changes)
    taken: set = set()
    changes.update({name: _token_ids(name, value, taken) for name, value in d.items() if _is_token_id(name)})
    if "is_decoder" in declared:  # an encoder family's causal-LM head attends causally only as a decoder
        changes["is_decoder"] = True
    _resize_layers(d, declared, changes)
    _window(d, changes)
    for name, sub in vars(config).items():
        if isinstance(sub, PreTrainedConfig):
            inner = given.get(name, {})
            changes[name] = {**_configured(sub), **inner, **shrink(sub, widths, inner)}
    return changes


def _fields(config: PreTrainedConfig) -> dict:
    """config.to_dict(), with the integer and list fields as the config object holds them. A family may serialize
    another layout than it runs (dory writes each layer as an attention and an mlp block and doubles the counts,
    undoing it on load); the layers are cut in the layout the model is built from."""
    d = config.to_dict()
    held = vars(config)
    for name in d:
        value = held.get(name)
        if (_is_int(value) or isinstance(value, list)) and value != d[name]:
            d[name] = value
    return d


def _declared(cls) -> dict:
    """The config class's fields and their declared defaults, under the names to_dict() uses (attribute_map
    aliases resolved: qwen3_moe declares num_experts, stored as num_local_experts)."""
    out = {}
    for f in dataclasses.fields(cls):
        out[f.name] = out[cls.attribute_map.get(f.name, f.name)] = f.default
    return out


def widths(config: PreTrainedConfig) -> frozenset:
    """The hidden sizes of a config and all its sub-configs (a vision adapter's output is the text width)."""
    out = {config.to_dict().get("hidden_size")}
    for sub in vars(config).values():
        if isinstance(sub, PreTrainedConfig):
            out |= widths(sub)
    return frozenset(w for w in out if _is_int(w))


def _configured(config: PreTrainedConfig) -> dict:
    """What a parent config set on a sub-config: its declared fields that differ from their defaults, without those
    that __post_init__ derives (declared None), which must be derived again from the tiny sizes."""
    d = config.to_dict()
    out = {"model_type": d["model_type"]} if d.get("model_type") else {}
    for name, default in _declared(type(config)).items():
        if name in d and default is not None and d[name] != default:
            out[name] = d[name]
    return out


