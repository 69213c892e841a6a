"""What an evaluation will cost, known before it runs: the memory it needs (from the model's config, before the
weights are loaded) and the time it will take (from a cost model calibrated by one timed forward).

Memory (bytes) of reading L tokens in one forward, b = bytes per activation, w = bytes per weight:
  weights      params * w
  activations  the residual stream in and out, plus the larger of one layer's attention tensors (q, k, v, output)
               and its MLP tensors (gate, up, their product): L * (2d + max(2 H hd + 2 KV hd + d, 3 ffn)) * b;
               eager attention also holds one layer's H x L x L scores
  hidden       the final hidden states kept for scoring: L * d * b
  scoring      one chunk of logits, their fp32 copy and the loss's log-softmax: chunk * vocab * (b + 4 + 4),
               the copy dropped when b = 4
  KV cache     generation only: 2 * layers * KV * hd * (L + new tokens) * b
Only one layer's intermediates exist at a time (no gradients), so the layer count enters through the cache alone.

Time: a forward that reads n tokens ending at k keys costs 2 * P_body * n (the linears) + 4 * H * hd * layers *
(the query-key pairs: n (k - n) + n (n + 1) / 2) (the attention) + 2 * d * vocab per position through the LM head
FLOPs. One timed forward of the loaded model gives FLOP/s; one timed single-token step gives the latency floor of
a decoding step. On 2 CPU cores this predicted SmolLM2's measured times at 2k-16k tokens within about 15 %
(README).
"""

from __future__ import annotations

import math
import os
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..models import resolve
from ..utils.host import available_bytes
from ..utils.timing import duration as duration  # importable from here too
from .causal import cache_keyword, cache_of

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

GiB = 1024**3


@dataclass(frozen=True)
class Shape:
    """The sizes the estimates need."""

    params: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    eager: bool = False  # eager attention materializes the scores

    @property
    def body_params(self) -> int:
        """Parameters that multiply every token (not the embedding lookup, not the LM head)."""
        return max(self.params - self.vocab * self.hidden * (1 if self.tied else 2), 0)


def shape_of_config(config: PreTrainedConfig) -> Shape:
    """From a transformers config: the parameter count from a model built on the meta device (no memory)."""
    text = config.get_text_config()
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    hidden = text.hidden_size
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    ffn = next((getattr(text, k) for k in ("intermediate_size", "ffn_dim", "n_inner") if getattr(text, k, None)),
               4 * hidden)
    return Shape(params=params, layers=text.num_hidden_layers, hidden=hidden, heads=heads,
                 kv_heads=getattr(text, "num_key_value_heads", None) or heads, head_dim=head_dim, ffn=ffn,
                 vocab=text.vocab_size, tied=bool(getattr(text, "tie_word_embeddings", True)),
                 eager=getattr(config, "_attn_implementation", None) == "eager")


# GGUF: the metadata and tensor sizes are read from the file's header. (gguf.GGUFReader parses every field,
# tokenizer arrays included: 16 s for SmolLM2's file; this reads the scalars and skips the arrays: milliseconds.)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _gguf_header(path: str) -> tuple[dict, int]:
    """({key: scalar or string value; arrays as their length}, total tensor elements). A length or count past the
    file's size is a ValueError: the file is not GGUF, or cut short (a damaged header must not ask for exabytes)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        def read(fmt: str) -> Any:
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

        def count(fmt: str = "Q") -> int:
            n = read(fmt)
            if n > size:
                raise ValueError(f"{path}: a GGUF header field claims {n} entries or bytes in a file of {size} bytes: "
                                 "the file is not GGUF, or cut short")
            return n

        def string() -> str:
            return f.read(count()).decode("utf-8", "replace")

        def value(kind: Any) -> Any:
            if kind == 8:
                return string()
            if kind == 9:
                item, items = read("I"), count()
                if item == 8:
                    for _ in range(items):
                        f.seek(count(), 1)
                elif item in _SCALARS:
                    f.seek(struct.calcsize("<" + _SCALARS[item]) * items, 1)
                else:
                    for _ in range(items):
                        value(item)
                return items
            return read(_SCALARS[kind])

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        read("I")  # version
        n_tensors, n_kv = count(), count()
        meta = {}
        for _ in range(n_kv):
            key = string()
            meta[key] = value(read("I"))
        elements = 0
        for _ in range(n_tensors):
            string()
            dims = [read("Q") for _ in range(count("I"))]
            read("I"), read("Q")  # type, offset
            elements += math.prod(dims)
    return meta, elements


def shape_of_gguf(path: str) -> Shape:
    meta, params = _gguf_header(path)
    arch = meta["general.architecture"]

    def get(key: Any, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    hidden, heads = get("embedding_length"), get("attention.head_count")
    vocab = cast(int, get("vocab_size") or meta.get("tokenizer.ggml.tokens"))  # the token list's length
    return Shape(params=params, layers=get("block_count"), hidden=hidden, heads=heads,
                 kv_heads=get("attention.head_count_kv", heads), head_dim=get("attention.key_length", hidden // heads),
                 ffn=get("feed_forward_length", 4 * hidden), vocab=vocab, tied=True)


def shape_of(name: str) -> Shape | None:
    """The shape of a model by name (as hfpatch.models.load takes it), without loading weights; None if its config
    cannot be read (loading the model will then say why)."""
    where, gguf_file = resolve(name)
    try:
        if gguf_file:
            return shape_of_gguf(os.path.join(where, gguf_file))
        return shape_of_config(AutoConfig.from_pretrained(where))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error):
        return None


# ---------------------------------------------------------------------------------------------------------------
# memory


def memory_needed(shape: Shape, weight_bytes: int, tokens: int, new_tokens: int = 0, score_chunk: int = 0) -> dict:
    """Bytes for reading `tokens` tokens in one forward (then generating `new_tokens` with a KV cache when > 0;
    scoring `score_chunk` positions at a time through the LM head when > 0), by part."""
    b = weight_bytes  # activations come out in the weights' dtype
    d, L = shape.hidden, tokens
    attn = 2 * shape.heads * shape.head_dim + 2 * shape.kv_heads * shape.head_dim + d
    parts = {
        "weights": shape.params * weight_bytes,
        "activations": L * (2 * d + max(attn, 3 * shape.ffn)) * b
        + (shape.heads * L * L * b if shape.eager else 0),
    }
    if score_chunk:
        parts["hidden"] = L * d * b
        # the head's logits, their fp32 copy (none when they already are fp32) and the loss's log-softmax
        parts["scoring"] = min(score_chunk, L) * shape.vocab * (8 if b == 4 else b + 8)
    if new_tokens:
        parts["kv_cache"] = 2 * shape.layers * shape.kv_heads * shape.head_dim * (L + new_tokens) * b
    parts["total"] = sum(parts.values())
    return parts


def available_memory(device: str | None, device_map: str | None) -> tuple[int | None, str]:
    """(bytes free where the model will run, where), None when it cannot be told."""

    on_gpu = device_map or (device or "").startswith("cuda") or device is None
    if on_gpu and torch.cuda.is_available():
        if device_map:  # accelerate spreads the model over every GPU (and offloads to the CPU past them)
            gpus = sum(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
            cpu = available_bytes()
            return gpus + (cpu or 0), "GPUs and CPU"
        index = torch.device(device or "cuda").index or 0
        return torch.cuda.mem_get_info(index)[0], f"cuda:{index}"
    return available_bytes(), "CPU"


def gb(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= 0.1 * GiB else f"{n / 1024**2:.0f} MiB"


# ---------------------------------------------------------------------------------------------------------------
# time


def forward_flops(shape: Shape, tokens: int, keys: int | None = None, head_positions: int = 0) -> float:
    """FLOPs of one forward that reads `tokens` new tokens, the last of which attends to `keys` keys (default
    `tokens`: no cache), sending `head_positions` positions through the LM head."""
    keys = tokens if keys is None else keys
    pairs = tokens * (keys - tokens) + tokens * (tokens + 1) / 2
    return (2 * shape.body_params * tokens + 4 * shape.heads * shape.head_dim * shape.layers * pairs
            + 2 * shape.hidden * shape.vocab * head_positions)


@dataclass
class Speed:
    flops_per_s: float  # sustained by a forward of calibration tokens
    step_s: float  # one decoding step (one token, with a cache): the floor of any forward
    calibration_tokens: int

    def seconds(self, shape: Shape, tokens: int, keys: int | None = None, head_positions: int = 0) -> float:
        return max(forward_flops(shape, tokens, keys, head_positions) / self.flops_per_s, self.step_s)


def measure_speed(parts: Any, shape: Shape, tokens: int) -> Speed:
    """Time one forward of `tokens` random tokens (after a short warm-up) and one decoding step after it."""

    def sync() -> None:
        if parts.input_device.type == "cuda":
            torch.cuda.synchronize(parts.input_device)

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape.vocab, (1, tokens), generator=g).to(parts.input_device)
    with torch.no_grad():
        parts.base(input_ids=ids[:, :16], use_cache=False)  # warm-up: first-call allocations, kernel selection
        sync()
        t0 = time.perf_counter()
        out = parts.base(input_ids=ids, use_cache=True)
        sync()
        t1 = time.perf_counter()
        parts.base(input_ids=ids[:, -1:], **{cache_keyword(parts.base): cache_of(out)}, use_cache=True)
        sync()
        t2 = time.perf_counter()
    flops = forward_flops(shape, tokens)
    return Speed(flops_per_s=flops / max(t1 - t0, 1e-9), step_s=t2 - t1, calibration_tokens=tokens)


def work_left(records: str, todo: Any) -> str:
    """The estimate line's count of work: cells and the units each reads, e.g. "6 cell(s) of 1 document each".
    Counted per cell, because one document read in six cells is one document, not six."""
    per_cell = sorted({len(left) for *_, left in todo})
    low, high = per_cell[0], per_cell[-1]
    if low == high:
        noun = records[:-1] if low == 1 and records.endswith("s") else records  # "1 document", "3 documents"
        return f"{len(todo)} cell(s) of {low} {noun} each"
    return f"{len(todo)} cell(s) of {low} to {high} {records} each"  # a resumed run: some cells partly done
