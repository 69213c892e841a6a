"""Memory options for long sequences. Each changes what is kept in memory and what is computed again, never the
arithmetic of a step: the loss and the gradients equal those of the plain step (tested to 1e-5 relative, fp32).

- gradient_checkpointing: transformers' activation checkpointing; each block keeps only its input between the
  forward and the backward pass and is run again in the backward pass.
- loss_chunk (losses.py): the LM head and the loss run `loss_chunk` positions at a time, each chunk recomputed in
  the backward pass, so [seq_len, vocab] logits never exist at once.
- fused_loss (losses.py): the cross-entropy's gradient made in the forward pass, one [chunk, vocab] buffer at a
  time, the LM head run once.
- fused_optimizer (loop.py): torch's fused AdamW, without the parameter-sized temporaries of the per-tensor one.
- release_memory (CPU, glibc): freed tensors go back to the operating system. glibc raises its mmap threshold as
  large blocks are freed (up to 32 MiB), after which tensors below it come from heaps that keep freed memory: in a
  long step the process held 0.76 GB more than its live tensors (measured: eval/memory_breakdown.py, 8 blocks at 8k).
  A fixed threshold of 1 MiB (mallopt, as MALLOC_MMAP_THRESHOLD_=1048576 would) maps each tensor of 1 MiB or more on
  its own and unmaps it when freed. The cost: fresh pages are faulted in for each such allocation. GPUs do not need
  it (their memory is torch's caching allocator's).
- mlp_tile: each block's feed-forward module runs `mlp_tile` positions at a time (ALST's tiled MLP), each tile
  under its own checkpoint, so the [seq_len, intermediate] activations (the largest a block makes: SwiGLU keeps four
  of them) exist for one tile at a time, in the forward pass and in the recomputation alike. Sequences no longer
  than a tile run the module as it is, at no cost.

Before the first step, the memory a step needs is estimated from the sizes (training_bytes) and a run that cannot
fit in what is free, less a reserve of 10 % of it (RESERVE), is refused (memory_check: false runs it anyway),
instead of being killed by the OS after it took all of it (batch_size=100000 was OOM-killed at 20 GB).

The feed-forward module is found through the family's adapter (`Adapter.mlp`) and given a subclass through
`hfpatch.edits.Edits.mix_in` (never `module.forward = ...`, which gradient checkpointing would not see); the returned
log undoes it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

import torch
from torch.utils.checkpoint import checkpoint

from ..adapters import adapter_for, get_path
from ..apply import unwrap
from ..edits import Edits
from ..lm import budget
from .config import RecipeConfig
from .losses import auto_chunk


class TiledMLP:
    """Mixed into a feed-forward module: the forward runs on tiles of `_hfpatch_mlp_tile` positions (dimension 1
    of the input), each tile checkpointed when autograd is recording, and the outputs are concatenated. A
    feed-forward module works on each position independently, so the result is the same function."""

    def forward(self, hidden_states, *args, **kwargs):
        tile = self._hfpatch_mlp_tile
        if hidden_states.dim() != 3 or hidden_states.shape[1] <= tile:
            return super().forward(hidden_states, *args, **kwargs)
        grad = torch.is_grad_enabled() and (hidden_states.requires_grad
                                            or any(p.requires_grad for p in self.parameters()))
        outs = []
        for part in hidden_states.split(tile, dim=1):
            if grad:  # only the tile's input (a view) is kept; contiguous() inside, so its copy is recomputed too
                outs.append(checkpoint(self._tile, part, *args, use_reentrant=False, **kwargs))
            else:
                outs.append(self._tile(part, *args, **kwargs))
        return torch.cat(outs, dim=1)

    def _tile(self, part, *args, **kwargs):
        # a slice of positions is not contiguous when batch > 1; some modules (GPT-2's Conv1D) need it to be
        return super().forward(part.contiguous(), *args, **kwargs)


def feed_forward_modules(model) -> list:
    """Each block's feed-forward module; ValueError where the family has none (its linears sit in the block)."""
    target = unwrap(model)
    adapter = adapter_for(target)
    if adapter.mlp is None:
        raise ValueError(f"mlp_tile: {adapter.model_type} blocks hold their feed-forward linears directly (no MLP "
                         f"module to tile); remove mlp_tile for this model")
    return [get_path(layer, adapter.mlp) for layer in get_path(target.base_model, adapter.layers)]


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
RELEASE_THRESHOLD = 1 << 20


def release_freed_memory() -> bool:
    """Fix glibc's mmap threshold at 1 MiB for this process (see the module docstring). False where the C library
    is not glibc (nothing to do there)."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        return bool(name) and hasattr(libc, "mallopt") and libc.mallopt(M_MMAP_THRESHOLD, RELEASE_THRESHOLD) == 1
    except OSError:
        return False


def apply(model, *, gradient_checkpointing: bool = False, mlp_tile: int | None = None) -> Edits:
    """Switch on the memory options on a model (a transformers model or a peft model around one). Returns the log
    of the changes (`.undo()` takes them back; gradient checkpointing stays on, as transformers sets it)."""
    edits = Edits()
    if mlp_tile is not None:
        if mlp_tile <= 0:
            raise ValueError(f"mlp_tile must be a number of positions > 0, got {mlp_tile}")
        for mlp in feed_forward_modules(model):
            edits.set(mlp, "_hfpatch_mlp_tile", mlp_tile)
            edits.mix_in(mlp, TiledMLP)
    if gradient_checkpointing:
        # every block is recomputed in the backward pass (patched blocks included: they swap classes, not forwards)
        unwrap(model).activation_checkpointing_enable({"use_reentrant": False})
    return edits


def training_bytes(cfg: RecipeConfig, model, teacher=None, processes: int = 1) -> dict:
    """Bytes one optimizer step needs at least, by part, on the device of one process (`processes` of them share
    it: CPU runs). A floor, not a forecast: what a step cannot do without.
      weights     every parameter (and the teacher's)
      optimizer   gradients and AdamW's two moments of the trained parameters (none counted under LoRA, whose
                  adapters are tiny)
      activations what the backward pass keeps of a micro-batch (B = batch_size, L = seq_len, d = hidden): with
                  gradient checkpointing each block's input (layers x B x L x d), without it at least the block's
                  largest intermediates as well; plus one block's peak (budget.memory_needed's formula)
      logits      the LM head's fp32 logits and their gradient, for the positions scored at once (loss_chunk)"""
    target = unwrap(model)
    shape = budget.shape_of_config(target.config)
    params = sum(p.numel() * p.element_size() for p in target.parameters())
    if teacher is not None:
        params += sum(p.numel() * p.element_size() for p in teacher.parameters())
    b = next(target.parameters()).element_size()
    trained = 0 if cfg.lora.enabled else sum(p.numel() for p in target.parameters() if p.requires_grad)
    rows, L, d = cfg.batch_size, cfg.seq_len, shape.hidden
    block = budget.memory_needed(shape, b, L)["activations"] * rows  # one block's peak, the whole micro-batch
    kept = rows * L * d * b if cfg.gradient_checkpointing else block
    chunk = auto_chunk(rows, L, shape.vocab, cfg.loss_chunk) or L
    parts = {"weights": params, "optimizer": trained * b * 3, "activations": shape.layers * kept + block,
             "logits": rows * min(chunk, L) * shape.vocab * 8}
    parts = {k: v * processes for k, v in parts.items()}
    parts["total"] = sum(parts.values())
    return parts


# Share of the free memory a run may not count on: training_bytes is a floor (the allocator's fragmentation, the
# framework's workspaces and the rest of the machine come on top), and a run that fills memory to the last byte is
# killed by the OS mid-step (an estimate of 22.25 GB against 23.5 GB free was).
RESERVE = 0.10


def check_fits(cfg: RecipeConfig, model, teacher=None) -> None:
    """Refuse (ValueError) a run whose training_bytes exceed the memory free where it runs, less RESERVE."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpu = torch.cuda.is_available()
    device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if gpu else "cpu"
    free, where = budget.available_memory(device, None)
    if free is None:
        return
    try:
        need = training_bytes(cfg, model, teacher, 1 if gpu else local)
    except (ValueError, TypeError, AttributeError, KeyError, RuntimeError):  # sizes the config does not say
        return
    # on the CPU this process's weights exist already: what is free was measured without them
    loaded = 0 if gpu else need["weights"] // local
    usable = int(free * (1 - RESERVE))
    if need["total"] - loaded <= usable:
        return
    detail = ", ".join(f"{k} {budget.gb(v)}" for k, v in need.items() if k != "total")
    who = f" ({local} processes)" if local > 1 and not gpu else ""
    raise ValueError(f"batch_size={cfg.batch_size} x seq_len={cfg.seq_len} needs at least about "
                     f"{budget.gb(need['total'])}{who} ({detail}) but {budget.gb(free)} is free on the {where}, of "
                     f"which {RESERVE:.0%} is kept in reserve ({budget.gb(usable)} usable): lower batch_size "
                     "(grad_accum keeps the tokens per step), turn on gradient_checkpointing, or set "
                     "memory_check=false to try anyway")
