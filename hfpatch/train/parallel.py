"""Splitting each sequence over several processes: torch context parallelism (accelerate's FSDP2 `cp_size`) and
DeepSpeed's Ulysses sequence parallelism (ALST, accelerate's `sp_size`). Both come from the accelerate config
(`parallelism_config:`, see recipes/accelerate/); the recipes' loop only has to

- give every process of one sequence group the same rows of the batch (the data-parallel rank decides the rows);
- pass position ids (and labels, shifted before the split) for the whole sequence, so each shard knows where its
  tokens are;
- scale each shard's loss so that the gradients, averaged over all processes, are those of the whole batch's mean.

Context parallelism (torch): accelerate's `maybe_context_parallel` shards the inputs, labels and positions in
place (load-balanced: shard r holds chunks r and 2n-1-r of 2n) and routes sdpa through ring attention. It drops every
attention mask (`attention_mask=None, is_causal=True` on each `self_attn`), so only plain causal attention can run.
Ulysses (DeepSpeed): each process holds a contiguous 1/n of the sequence; before attention an all-to-all gives each
process the whole sequence for 1/n of the heads, through the attention function DeepSpeed registers in place of the
model's own.

What cannot work is refused before training (`check`), with the reason:
- position schemes whose registry record says why (position/registry.py, `split`): those that run their own attention
  function (ALiBi, T5, Transformer-XL, Self-Extend) read key positions from the local shard's slots (ALiBi also
  holds one slope per head of the whole model, where Ulysses hands it 1/n of the heads); dynamic and dynamic-yarn
  RoPE take the scale from the largest position id each process sees, which differs between shards;
- PoSE under Ulysses: DeepSpeed reads every jump in the position ids as a document boundary (sdpa refuses packed
  documents, flash attention masks across them); under context parallelism the masks are dropped and the jumps
  only reach RoPE, as PoSE needs.
- distillation (heal): the teacher runs on the local shard without the sequence's other shards.
- sequence lengths that do not split evenly (2 x cp_size chunks for context parallelism, sp_size for Ulysses).
Sliding-window models are refused by accelerate and DeepSpeed themselves.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..position.registry import SCHEMES
from .config import ConfigError, RecipeConfig


@dataclass(frozen=True)
class Layout:
    """How this process's batch is chosen and its sequences split."""
    data_rank: int  # which rows of the global batch this process trains on ...
    data_size: int  # ... out of this many groups of rows
    split: str | None = None  # "cp" (torch context parallelism), "sp" (DeepSpeed Ulysses) or None
    size: int = 1  # processes sharing one sequence
    rank: int = 0  # this process's shard (Ulysses: contiguous; context parallelism: accelerate decides)


def requested() -> tuple[int, int]:
    """(cp_size, sp_size) that `accelerate launch` was given (its PARALLELISM_CONFIG_* environment)."""
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return 1, 1
    return (int(os.environ.get("PARALLELISM_CONFIG_CP_SIZE", "1")),
            int(os.environ.get("PARALLELISM_CONFIG_SP_SIZE", "1")))


def check(cfg: RecipeConfig, scheme: str) -> None:
    """ConfigError for what cannot run under the requested sequence split (see the module docstring)."""
    cp, sp = requested()
    if cp == 1 and sp == 1:
        return
    name = f"context parallelism (cp_size={cp})" if cp > 1 else f"Ulysses sequence parallelism (sp_size={sp})"
    why = refusal(scheme)
    if why:
        raise ConfigError(f"position={scheme!r} cannot train under {name}: {why}; use a static RoPE scheme (e.g. "
                          f"yarn) or train without splitting sequences")
    if sp > 1 and cfg.pose_positions() is not None:
        raise ConfigError(f"pose cannot train under {name}: DeepSpeed reads PoSE's position jumps as document "
                          f"boundaries; use context parallelism (FSDP2 cp_size) for PoSE")
    if cfg.distillation() is not None:
        raise ConfigError(f"distillation cannot train under {name}: the teacher would see one shard of each "
                          f"sequence; heal without splitting sequences")
    parts = 2 * cp if cp > 1 else sp
    if cfg.seq_len % parts:
        raise ConfigError(f"seq_len={cfg.seq_len} must be a multiple of {parts} under {name}")


def refusal(scheme: str) -> str | None:
    """Why a position scheme cannot train with split sequences (None: it can): its registry record's `split`."""
    record = SCHEMES.get(scheme)
    return None if record is None else record.split


def layout(accelerator) -> Layout:
    pc = accelerator.parallelism_config
    if pc is not None and pc.cp_enabled:
        mesh = accelerator.torch_device_mesh
        names = mesh.mesh_dim_names or ()
        rank, size = (mesh["dp"].get_local_rank(), mesh["dp"].size()) if "dp" in names else (0, 1)
        return Layout(rank, size, "cp", pc.cp_size, mesh["cp"].get_local_rank())
    if pc is not None and pc.sp_enabled:
        # DeepSpeed's groups: consecutive ranks share a sequence
        index = accelerator.process_index
        return Layout(index // pc.sp_size, accelerator.num_processes // pc.sp_size, "sp", pc.sp_size,
                      index % pc.sp_size)
    return Layout(accelerator.process_index, accelerator.num_processes)


def contiguous_shard(lay: Layout, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Ulysses' split: shard `lay.rank` of `lay.size` equal contiguous pieces along the sequence (dimension 1)."""
    return [t.chunk(lay.size, dim=1)[lay.rank].contiguous() for t in tensors]
