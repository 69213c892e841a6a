"""A causal LM split into its body and its head, for what the evaluations do with it: the negative log-likelihood of
long token sequences without full-vocabulary logits for the whole sequence, and greedy decoding with a KV cache.

`model(ids, labels=ids)` builds [L, vocab] logits, an fp32 copy and the log-softmax: 16k tokens x 49k vocab is
3.2 GB per copy, about 10 GB at peak for SmolLM2-135M. Here the base model (the transformer without its LM head)
runs once over the window, and its final hidden states go through the LM head `chunk` positions at a time; each
chunk's logits are reduced to a summed cross-entropy and dropped. Same numbers, memory bounded by the chunk.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..adapters import adapter_for
from ..apply import unwrap
from .windows import windows as windows  # importable from here too

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel


@dataclass
class LMParts:
    """A causal LM as body and head; it scores and decodes (the evaluations' Scorer, evaluate/engines.py)."""

    base: torch.nn.Module  # transformer body: input_ids -> final (normed) hidden states
    head: torch.nn.Module  # LM head: hidden -> vocabulary logits
    softcap: float | None  # gemma2/3 cap their final logits: cap * tanh(logits / cap)
    input_device: torch.device

    def document_nll(self, ids: Any, spans: list[tuple[int, int, int]], chunk: int = 1024,
                     progress: Any = None) -> tuple[float, int, list[tuple[int, int]]]:
        """document_nll(self, ...) below: the NLL over the windows of `ids`."""
        return document_nll(self, ids, spans, chunk, progress)

    def greedy(self, ids: list[int], new_tokens: int, eos: set[int], done: Any = None) -> list[int]:
        """greedy(self, ...) below: greedy decoding with a KV cache."""
        return greedy(self, ids, new_tokens, eos, done)


def softcap_of(config: PreTrainedConfig) -> float | None:
    """The cap a family puts on its final logits (gemma2/3: cap * tanh(logits / cap)), None where it has none."""
    return getattr(config, "final_logit_softcapping", None) or None


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap), as the model's own forward computes it (in the logits' dtype); the logits where
    there is no cap."""
    return torch.tanh(logits / cap) * cap if cap else logits


def _not_causal(name: str, model_type: str | None) -> ValueError:
    return ValueError(
        f"{name} ({model_type}) is not a causal language model; perplexity and passkey retrieval need a model that "
        "predicts the next token (a ...ForCausalLM / ...LMHeadModel class)"
    )


def check_causal_config(config: PreTrainedConfig) -> None:
    """The same refusal from a config alone (its `architectures`), before any weights are loaded."""
    archs = getattr(config, "architectures", None) or []
    if archs and not set(archs) & set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        raise _not_causal(archs[0], config.model_type)


def causal_lm_parts(model: PreTrainedModel) -> LMParts:
    """Split a causal LM into its body and head; ValueError for models that do not predict the next token."""
    target = unwrap(model)
    config = target.config
    name = type(target).__name__
    causal_classes = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if name not in causal_classes:
        raise _not_causal(name, config.model_type)
    encoder = not adapter_for(target).causal and not getattr(config, "is_decoder", False)
    if encoder:
        raise _not_causal(name, config.model_type)
    head = target.get_output_embeddings()
    base = target.base_model
    if head is None or base is target:
        raise ValueError(f"{name}: cannot find its LM head and base model separately")
    device = cast(torch.Tensor, target.get_input_embeddings().weight).device
    if device.type == "meta":  # offloaded by accelerate (device_map): its hooks move the inputs where they run
        device = torch.device("cpu")
    return LMParts(base, head, softcap_of(config), device)


def head_logits(parts: LMParts, h: torch.Tensor) -> torch.Tensor:
    """fp32 logits of hidden states h [..., d], soft-capped where the family caps them."""
    w = getattr(parts.head, "weight", None)
    if w is not None and w.device.type != "meta" and h.device != w.device:  # sharded by device_map: the last
        h = h.to(w.device)  # layer and the head may sit on different GPUs
    # like transformers' loss: logits in the model's dtype, upcast for the loss, then capped
    return softcap(parts.head(h).float(), parts.softcap)


@torch.no_grad()
def window_nll(parts: LMParts, ids: torch.Tensor, first: int = 1, chunk: int = 1024) -> tuple[float, int]:
    """(sum of -log p(ids[t] | ids[:t]) for t in first..len-1, number of terms), from one forward of ids[:-1] (the
    last token is only a target: the model reads n - 1 tokens)."""
    n = ids.shape[-1]
    if not 1 <= first < n:
        raise ValueError(f"first scored position must be in [1, {n}), got {first}")
    x = ids.reshape(1, n).to(parts.input_device)
    out = parts.base(input_ids=x[:, : n - 1], use_cache=False)
    h = (out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])[0, first - 1 : n - 1]
    del out
    targets = x[0, first:n]
    total = torch.zeros((), dtype=torch.float64)
    for i in range(0, h.shape[0], chunk):
        logits = head_logits(parts, h[i : i + chunk])
        nll = F.cross_entropy(logits, targets[i : i + chunk].to(logits.device), reduction="sum")
        total += nll.double().cpu()
        del logits, nll
    return float(total), n - first


@torch.no_grad()
def logits_nll(model: PreTrainedModel, seqs: torch.Tensor, first: int = 1, batch: int = 1) -> tuple[float, int]:
    """(sum of -log p(seqs[:, t] | seqs[:, :t]) for t in first..len-1, number of terms) from the model's own logits,
    `batch` sequences per forward: every position goes through the LM head at once (for small models, and any
    module whose output has .logits), where window_nll keeps the head to chunks."""
    total, count = 0.0, 0
    for i in range(0, len(seqs), batch):
        x = seqs[i:i + batch]
        logits = model(input_ids=x, use_cache=False).logits[:, first - 1:-1].float()
        total += float(F.cross_entropy(logits.flatten(0, 1), x[:, first:].flatten(), reduction="sum"))
        count += x[:, first:].numel()
    return total, count


def document_nll(parts: LMParts, ids: Any, spans: list[tuple[int, int, int]], chunk: int = 1024,
                 progress: Any = None) -> tuple[float, int, list[tuple[int, int]]]:
    """(nll sum, tokens scored, [(a, b)] runs of scored token indices) over the given windows of `ids`;
    progress(n) is told the tokens read after each window."""
    ids = torch.as_tensor(ids)
    total, count, runs = 0.0, 0, []
    for start, end, first in spans:
        nll, n = window_nll(parts, ids[start:end], first, chunk)
        total += nll
        count += n
        runs.append((start + first, end))
        if progress is not None:
            progress(end - start - 1)
    return total, count, runs


def cache_keyword(base: torch.nn.Module) -> str:
    """The keyword that hands a KV cache back to the base model's forward: `cache` where the forward takes it (the
    name transformers moved to), else `past_key_values` (read off the forward, not the version)."""
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def cache_of(out: Any) -> object:
    """The KV cache a forward returned, under either name (`cache`, or `past_key_values` before it)."""
    return out["cache"] if "cache" in out else out["past_key_values"]


@torch.no_grad()
def greedy(parts: LMParts, ids: list[int], new_tokens: int, eos: set[int], done: Any = None) -> list[int]:
    """Greedy decoding with a KV cache: one forward over the prompt, then one token at a time, up to new_tokens,
    an EOS token, or done(generated) returning True. Only the last position goes through the LM head (no [L,
    vocab] logits)."""
    x = torch.tensor([ids], device=parts.input_device)
    out = parts.base(input_ids=x, use_cache=True)
    past, generated, keyword = cache_of(out), [], cache_keyword(parts.base)  # read once, not at every step
    h = out.last_hidden_state[:, -1]
    for _ in range(new_tokens):
        nxt = int(head_logits(parts, h).argmax(-1)[0])
        generated.append(nxt)
        if nxt in eos or len(generated) == new_tokens or (done is not None and done(generated)):
            break
        out = parts.base(input_ids=torch.tensor([[nxt]], device=parts.input_device), **{keyword: past},
                         use_cache=True)
        past, h = cache_of(out), out.last_hidden_state[:, -1]
    return generated
