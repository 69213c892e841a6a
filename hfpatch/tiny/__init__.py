"""Tiny random models of every causal-LM family transformers ships, built from the family's own config class.

`hfpatch supported` measures what applies to each family on such a model, and the tests sweep them family-wide.

A family's default config is shrunk by general rules over attribute names, not per family: whatever a family calls
its hidden size, layer count, heads, experts, MLA ranks or Mamba state, one table says what it becomes. Sizes that a
family derives from others are left for it to derive again, and the few relations that configs validate (MLA head
split, Mamba heads x head size = expand x hidden, a sub-config's width = the text width) are kept as the default
has them. Per-layer attributes (`layer_types`, `mlp_layer_types`, flags and index lists, `per_layer_config`) are cut
together by keeping the first layer of every distinct kind, so a tiny hybrid keeps its attention *and* its Mamba /
linear-attention layers and a tiny MoE its dense *and* sparse layers. RoPE settings stay as the default config has
them; only the window moves to WINDOW. Hand-written entries exist only where a rule cannot work (`_DEFAULTS`,
`_TINY`, `_AFTER_BUILD`, `EXPECTED_FAILURES`), each with the reason.
"""

from __future__ import annotations

import contextlib
import string
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    PreTrainedTokenizerFast,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils import is_timm_available
from transformers.utils import logging as hf_logging

from .shrink import (  # the sizes every tiny model has, public here as before
    EXPERT_INTERMEDIATE as EXPERT_INTERMEDIATE,
)
from .shrink import (
    EXPERTS as EXPERTS,
)
from .shrink import (
    HEAD_DIM as HEAD_DIM,
)
from .shrink import (
    HEADS as HEADS,
)
from .shrink import (
    HIDDEN as HIDDEN,
)
from .shrink import (
    INTERMEDIATE as INTERMEDIATE,
)
from .shrink import (
    KV_HEADS as KV_HEADS,
)
from .shrink import (
    LAYERS as LAYERS,
)
from .shrink import (
    SLIDING as SLIDING,
)
from .shrink import (
    TOP_K as TOP_K,
)
from .shrink import (
    VOCAB as VOCAB,
)
from .shrink import (
    WINDOW as WINDOW,
)
from .shrink import (
    shrink,
    widths,
)

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel


class TinyBuildError(RuntimeError):
    """A family that cannot be built tiny on a CPU, or whose forward on input_ids fails; the message is one line."""


# --- where a rule cannot work ----------------------------------------------------------------------------------------
# Values a family's default config lacks, given to it before the rules run: the default leaves None where the model
# needs a value, or is all of one kind where the family's checkpoints mix kinds. Tiny values (the rules skip fields
# declared None).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "bamba": {"attn_layer_indices": [1]},  # default: no attention layer at all
    "granitemoehybrid": {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]},  # ditto
    "lfm2": {"full_attn_idxs": [2, 5, 8, 10, 12, 14]},  # default: every layer attention, no short convolution
    "lfm2_moe": {"num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"]},  # default: None
    "deepseek_v2": {"num_experts_per_tok": 6},  # default: None
    "dots1": {"n_routed_experts": 128, "num_experts_per_tok": 8, "n_shared_experts": 1},  # default: None
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "qwen4_exp_text": {"indexer_n_heads": 16, "indexer_kv_heads": 1, "indexer_head_dim": 256,
                       "indexer_budget": SLIDING, "indexer_compress_ratio": 4},  # indexed layers, no indexer sizes
    # the attention reads attn_config.rope_theta and clamps q/k/v to clip_qkv, neither set by default
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
}
_DEFAULTS["qwen4_exp"] = {"text_config": _DEFAULTS["qwen4_exp_text"]}
_DEFAULTS["cohere_compass"] = {"text_config": _DEFAULTS["cohere_compass_text"]}

# Tiny values that overrule the rules.
_TINY: dict[str, dict[str, Any]] = {
    # xLSTM's cache rounds its q/k and v widths up to multiples of 64, its layers do not: widths multiple of 128
    "xlstm": {"hidden_size": 2 * HIDDEN},
    # zamba shares one attention block among its hybrid layers and ties it only where two layers use it
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
    # moshi's attention mask is fully causal (it ignores sliding_window) while DynamicCache(config) keeps only the
    # last sliding_window tokens: a window below the lengths tests run makes cached decoding differ from uncached
    # in transformers 5.23 itself, so the tiny moshi keeps its default window, longer than anything it runs
    "moshi": {"sliding_window": 3000},
    # reformer: axial position embeddings factor the window and split the hidden size; chunks below the window
    "reformer": {"attn_layers": ["local", "lsh"], "axial_pos_shape": [8, 8], "axial_pos_embds_dim": [16, 48],
                 "local_attn_chunk_length": SLIDING, "lsh_attn_chunk_length": SLIDING},
}


def _set_language(model: Any) -> None:
    model.set_default_language(model.config.languages[0])


# Steps a built model needs before it runs on input_ids alone.
_AFTER_BUILD = {"xmod": _set_language}  # language adapters: one must be chosen

# Families that cannot be built tiny on a CPU, or whose forward / cached generate on input_ids alone fails, and why.
# tests/test_tiny.py checks that each still fails (and that every other family builds, runs and generates).
EXPECTED_FAILURES: dict[str, str] = {
    # transformers 5.23 builds DynamicCache(config=BltConfig), which has no num_hidden_layers: any forward with
    # use_cache (the default) and generate fail; use_cache=False runs
    "blt": "its cache is built from BltConfig, which has no num_hidden_layers (transformers 5.23): forward with "
           "use_cache and generate fail",
    # speculative-decoding drafters: they read keys/values from their target model (shared_kv_states)
    "gemma4_assistant": "a drafter that reads its target model's keys/values; its default config fails its own "
                        "validation (hidden_size_per_layer_input must be 0)",
    "gemma4_unified_assistant": "a drafter that reads its target model's keys/values: every layer is a kv-sharing "
                                "consumer, so it does not run on input_ids alone",
    # MusicgenForCausalLM decodes audio codebooks and is built from the decoder sub-config, not from the composite
    # MusicgenConfig that the causal-LM mapping pairs it with
    "musicgen": "an audio-codebook decoder: AutoModelForCausalLM.from_config(MusicgenConfig) fails (it needs the "
                "decoder sub-config)",
    "musicgen_melody": "an audio-codebook decoder: AutoModelForCausalLM.from_config(MusicgenMelodyConfig) fails "
                       "(it needs the decoder sub-config)",
}
if not is_timm_available():
    # the causal-LM class of the composite config is Gemma3nForConditionalGeneration, whose vision tower is a timm
    # model (gemma3n_text is the text decoder alone and builds); not tried with timm installed
    EXPECTED_FAILURES["gemma3n"] = "its vision tower needs the timm package, which is not installed (gemma3n_text " \
                                   "builds)"


# --- public API ------------------------------------------------------------------------------------------------------
def causal_lm_types() -> list[str]:
    """Every model_type that transformers maps to a causal-LM class, sorted."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """transformers' logging at error level only, restored afterwards."""
    old = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(old)


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def tiny_config(model_type: str, **overrides: Any) -> PreTrainedConfig:
    """The family's own config class with every size shrunk; `overrides` are passed to it last."""
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"unknown model_type {model_type!r}; accepted: a key of transformers' CONFIG_MAPPING")
    cls = CONFIG_MAPPING[model_type]
    given = _DEFAULTS.get(model_type, {})
    with quiet():
        try:
            default = cls(**given)
        except Exception as e:
            raise TinyBuildError(f"{model_type}: default config does not build ({_one_line(e)})") from e
        changes = {**given, **shrink(default, widths(default), given), **_TINY.get(model_type, {}), **overrides}
        try:
            return cls(**changes)
        except Exception as e:
            raise TinyBuildError(f"{model_type}: tiny config rejected ({_one_line(e)})") from e


def text_config(config: PreTrainedConfig) -> PreTrainedConfig:
    """The decoder's config: config.get_text_config(decoder=True)."""
    return config.get_text_config(decoder=True)


def has_rope(config: PreTrainedConfig) -> bool:
    """Whether the (text) config carries RoPE: rope_parameters, rope_theta or rope_scaling, and no switch leaves
    them unused (granitemoehybrid's position_embedding_type None, zamba2's use_mem_rope False). Families that
    rotate with a fixed base and no RoPE in their config (gptj, codegen, roformer) do not count."""
    text = vars(text_config(config))
    if not any(text.get(name) for name in ("rope_parameters", "rope_theta", "rope_scaling")):
        return False
    if "position_embedding_type" in text and text["position_embedding_type"] not in ("rope", "rotary"):
        return False
    return not any(value is False for name, value in text.items() if name.startswith("use_") and "rope" in name)


def sample_ids(batch: int = 1, length: int = 8, seed: int = 1) -> torch.Tensor:
    """Token ids inside the tiny vocabulary, clear of the special tokens at its ends."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB - 8, (batch, length), generator=g)


def from_config(config: PreTrainedConfig, seed: int = 0, norm_noise: float = 0.0,
                auto_class: Any = AutoModelForCausalLM, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """The one way a tiny model is made: `auto_class.from_config(config)` (in `dtype` if given, which the config then
    records) with the RNG seeded by `seed`, in eval mode; with `norm_noise`, every norm weight moved off its init by
    N(0, norm_noise²) (perturb_norms)."""
    torch.manual_seed(seed)
    model = auto_class.from_config(config, **({"dtype": dtype} if dtype is not None else {}))
    if norm_noise:
        perturb_norms(model, norm_noise)
    return model.eval()


def perturb_norms(model: PreTrainedModel, scale: float = 0.1) -> None:
    """Norm weights and biases plus N(0, scale²) noise from the global RNG, so that a test notices a norm that is
    lost or mis-scaled (their init, all ones or zeros, hides both)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or "ln_" in name:
                p.add_(scale * torch.randn_like(p))


def _build(model_type: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    config = tiny_config(model_type, **overrides)
    with quiet():
        try:
            model = from_config(config, seed, dtype=torch.float32)
        except Exception as e:
            raise TinyBuildError(f"{model_type}: model does not build ({_one_line(e)})") from e
        if model_type in _AFTER_BUILD:
            _AFTER_BUILD[model_type](model)
        try:
            with torch.no_grad():
                model(sample_ids())
        except Exception as e:
            raise TinyBuildError(f"{model_type}: forward on input_ids fails ({_one_line(e)})") from e
    return model


@torch.no_grad()
def greedy_check(model: Any, prompt: int = 24, new_tokens: int = 3) -> tuple[torch.Tensor, list[float]]:
    """Cached greedy generation of a few tokens after `prompt` sample tokens (24: past the tiny sliding windows, so
    their caches roll over). Returns the generated sequences and, per step, the largest difference between the
    step's logits (before the family's logits processors) and an uncached forward over the same tokens."""
    ids = sample_ids(length=prompt)
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    diffs = [(logits - model(out.sequences[:, : prompt + step], use_cache=False).logits[:, -1]).abs().max().item()
             for step, logits in enumerate(out.logits)]
    return out.sequences, diffs


def stepped_and_full(model: PreTrainedModel, length: int = 33, steps: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """(the logits of a cached prefill's last token and of `steps - 1` one-token steps on its DynamicCache, the
    uncached forward's logits at the same tokens) on `length` sample tokens. The defaults step over kv lengths
    29..32: past the tiny sliding windows, and a length where a family that picks keys in blocks (qwen4_exp's indexer
    of 4-token blocks) can hide the newest slot from the newest query."""
    ids = sample_ids(length=length)
    prefill = length - steps
    with torch.no_grad():
        full = model(ids, use_cache=False).logits[:, prefill - 1:-1]
        out = model(ids[:, :prefill], use_cache=True)
        got = [out.logits[:, -1]]
        for i in range(prefill, length - 1):
            got.append(model(ids[:, i:i + 1], past_key_values=out.past_key_values, use_cache=True).logits[:, -1])
    return torch.stack(got, 1), full


def build_tiny(model_type: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """AutoModelForCausalLM.from_config(tiny_config(...)): fp32, eval mode, seeded, the family's default attention
    implementation; checked by one forward pass on input_ids. Raises TinyBuildError (one line) where it cannot."""
    if model_type in EXPECTED_FAILURES:
        raise TinyBuildError(f"{model_type}: {EXPECTED_FAILURES[model_type]}")
    return _build(model_type, seed, **overrides)


# --- hand-sized models ----------------------------------------------------------------------------------------------
# The models the test suite checks numerically: a few families at sizes written out here (not shrunk by the rules
# above), a vocabulary of SIZED_VOCAB ids (that of char_tokenizer), random norm weights (perturb_norms). BERT is its
# masked-LM model: the bidirectional case.
SIZED_VOCAB = 101
_SIZED_COMMON = dict(vocab_size=SIZED_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=WINDOW, pad_token_id=0, bos_token_id=1,
                     eos_token_id=2)
SIZED: dict[str, dict] = {
    "llama": dict(_SIZED_COMMON, num_key_value_heads=2),
    "mistral": dict(_SIZED_COMMON, num_key_value_heads=2),
    "qwen2": dict(_SIZED_COMMON, num_key_value_heads=2),
    "qwen3": dict(_SIZED_COMMON, num_key_value_heads=2),
    "gemma": dict(_SIZED_COMMON, num_key_value_heads=2),
    "gemma2": dict(_SIZED_COMMON, num_key_value_heads=2, head_dim=16, sliding_window=16),
    "gemma3_text": dict(_SIZED_COMMON, num_key_value_heads=2, head_dim=16, sliding_window=16,
                        layer_types=["sliding_attention", "full_attention"]),
    "phi3": dict(_SIZED_COMMON, original_max_position_embeddings=WINDOW),
    "olmo2": dict(_SIZED_COMMON, num_key_value_heads=2),
    "gpt_neox": dict(_SIZED_COMMON, hidden_size=128, partial_rotary_factor=0.25),  # head 32, 8 rotated channels
    "gpt2": dict(vocab_size=SIZED_VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=WINDOW, bos_token_id=1,
                 eos_token_id=2),
    "opt": dict(_SIZED_COMMON, ffn_dim=128, word_embed_proj_dim=64),
    "bert": dict(_SIZED_COMMON),
}
_ENCODERS = {"bert"}  # built as masked LMs


def sized_config(model_type: str, **overrides: Any) -> PreTrainedConfig:
    """The hand-sized config of `model_type` (a key of SIZED; any other family with the common sizes), `overrides`
    applied last."""
    config = AutoConfig.for_model(model_type, **{**SIZED.get(model_type, dict(_SIZED_COMMON, num_key_value_heads=2)),
                                                 **overrides})
    text = config.get_text_config()
    if text is not config:
        # A composite config (gemma3, llava, ...) keeps the sizes at its top level and builds its text model from the
        # full-sized default sub-config: a "hand-sized" gemma3 would have 2.7 B parameters.
        raise ValueError(f"sized_config: {model_type!r} is a composite config whose text model would keep its full "
                         f"default size; ask for the text model's own type ({text.model_type!r})")
    return config


def sized_model(model_type: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A hand-sized model: sized_config, seeded, with its norm weights perturbed (scale 0.1)."""
    config = sized_config(model_type, **overrides)
    auto_class = AutoModelForMaskedLM if model_type in _ENCODERS else AutoModelForCausalLM
    return from_config(config, seed, norm_noise=0.1, auto_class=auto_class)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer with exactly the hand-sized models' 101 ids (pad 0, bos 1, eos 2, unk 3): each
    printable ASCII character is one token; anything else (é, emoji) is one <unk> token that owns 2-4 bytes."""
    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>", *chars])}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")


def char_text(n_chars: int, seed: int) -> str:
    """Deterministic pseudo-text for char_tokenizer, with some multi-byte characters (2-byte é, 4-byte emoji)."""
    g = torch.Generator().manual_seed(seed)
    alphabet = [*string.ascii_lowercase, *"     .,\n", "é", "\U0001F600"]
    return "".join(alphabet[i] for i in torch.randint(0, len(alphabet), (n_chars,), generator=g).tolist())


def save_sized(path: Path | str, model_type: str = "llama") -> Path | str:
    """A hand-sized model and the char tokenizer saved in folder `path` (a model any command can load); `path`."""
    sized_model(model_type).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path
