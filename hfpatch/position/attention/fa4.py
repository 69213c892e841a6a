"""FlashAttention-4 (the `flash-attn-4` package, imported as `flash_attn.cute`: CuTe DSL kernels) for the position
schemes, on CUDA devices of compute capability 9.x to 11.x (Hopper, Blackwell).

FA4's own API is used, `flash_attn.cute.flash_attn_func(q, k, v, causal=..., score_mod=..., score_mod_bwd=...,
aux_tensors=..., return_lse=True)`, not torch's `flex_attention(..., kernel_options={"BACKEND": "FLASH"})`: the
latter routes to FA4 from torch 2.13 only, and it compiles the score_mod through inductor; FA4's API runs on the
torch the GPU machines have (2.11) and returns a log-sum-exp that passes gradients, which the merges of several
calls need.

- A score_mod is a CuTe DSL function `score_mod(scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors)` on vectors
  of scaled scores and their indices; indices are local to the call, and causal calls are aligned bottom-right (the
  queries are the last q of the keys), so a query's slot is q_idx + seqlen_k - seqlen_q. Tensors it reads are
  `aux_tensors`, indexed one element at a time through a register fragment. Its backward (`score_mod_bwd`) returns
  the gradient of the scores before the mod: an additive bias passes it through unchanged.
- FA4 compiles each kind of call (score_mod, head sizes, causal or not, ...) once per process; a kernel that
  fails to compile or run makes FA4 step aside for the rest of the process with a warning (paths.PathUnavailable:
  the call goes to the next path), as a failed flex compilation does.
- Padding masks are not handled (the paths that use FA4 take calls without an attention mask; batches with padding
  take the next path).

The score_mods are defined on first use (cutlass imports only where FA4 runs).
"""

from __future__ import annotations

import functools
import importlib.util
import operator
import warnings
from collections.abc import Callable
from typing import Any

import torch

from . import paths

CAPABILITIES = frozenset({9, 10, 11})  # compute capability majors: Hopper (9.0), Blackwell (10.x, 11.x)
PACKAGE = "flash_attn.cute"

_failed: dict[str, str] = {}  # "run": why FA4 failed in this process (its paths then step aside)


def package_present() -> bool:
    """Whether the flash-attn-4 package (flash_attn.cute) can be imported here."""
    try:
        return importlib.util.find_spec(PACKAGE) is not None
    except (ImportError, ValueError):  # no flash_attn at all, or a broken one
        return False


def capability() -> tuple[int, int]:
    """The CUDA device's compute capability (major, minor)."""
    major, minor = torch.cuda.get_device_capability()
    return int(major), int(minor)


def missing() -> str | None:
    """Why FA4 cannot run here, or None: the package, a CUDA device, its compute capability, an earlier failure."""
    if _failed:
        return f"FlashAttention-4 failed in this process ({_failed['run']})"
    if not package_present():
        return "the flash-attn-4 package (flash_attn.cute) is not installed"
    if not torch.cuda.is_available():
        return "FlashAttention-4 needs a CUDA device"
    major, minor = capability()
    if major not in CAPABILITIES:
        return (f"FlashAttention-4's score_mod paths need compute capability 9.x-11.x (Hopper, Blackwell); this "
                f"device has {major}.{minor}")
    return None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, causal: bool,
           window: tuple[int | None, int | None] = (None, None), score_mod: Any = None, score_mod_bwd: Any = None,
           aux: list[torch.Tensor] | None = None, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [b, H, q, d], log-sum-exp [b, H, q] float32) of one FA4 call on [b, H, n, d] tensors (grouped keys as
    they are). Causal and `window` (left, right) are aligned bottom-right. Both outputs pass gradients."""
    from flash_attn.cute import flash_attn_func  # the optional package: only where missing() says it runs

    try:
        out, lse = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                                   causal=causal, window_size=window, softcap=softcap or 0.0, score_mod=score_mod,
                                   score_mod_bwd=score_mod_bwd, aux_tensors=aux, return_lse=True)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # compilation or launch: never silent, and never again in this process
        _failed["run"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
        warnings.warn(f"hfpatch: FlashAttention-4 failed ({_failed['run']}); this process uses the next attention "
                      "path instead", RuntimeWarning, stacklevel=2)
        raise paths.PathUnavailable(_failed["run"]) from e
    return out.transpose(1, 2), lse


def require_plain_causal(attention_mask: torch.Tensor | None, q_len: int, kv_len: int) -> None:
    """Raise paths.PathUnavailable unless the call is causal attention with no padding: no mask, or a bool mask that
    is exactly causal (queries the last q_len of the key slots), as transformers gives a KV-cached call."""
    if attention_mask is None:
        return
    if attention_mask.dtype == torch.bool:
        slots = torch.arange(kv_len, device=attention_mask.device)
        causal = slots[None, :] <= slots[kv_len - q_len:, None]
        if bool((attention_mask[..., :kv_len] == causal).all()):
            return
    raise paths.PathUnavailable("a padding mask (FlashAttention-4's paths take causal calls without one)")


# ------------------------------------------------------------------------------------------------------ score_mods

@functools.cache
def additive_bwd() -> Callable[..., Any]:
    """score_mod_bwd of any additive bias: the gradient of the scores passes through."""
    import cutlass.cute as cute

    @cute.jit
    def backward(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return grad

    return backward


@functools.cache
def alibi_mod() -> Callable[..., Any]:
    """ALiBi: score - slope[h] * (query slot - key slot); aux_tensors[0] the slopes [H] in float32."""
    import cutlass
    import cutlass.cute as cute

    @cute.jit
    def mod(scores, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        slopes = aux_tensors[0]
        head = cute.make_rmem_tensor(1, cutlass.Int32)
        head.store(h_idx)
        slope = cute.make_rmem_tensor(1, cutlass.Float32)
        slope[0] = slopes[head[0]]
        distance = q_idx + (seqlen_info.seqlen_k - seqlen_info.seqlen_q) - kv_idx
        return scores - slope.load() * distance.to(cutlass.Float32)

    return mod


@functools.cache
def near_far_mod(D: int) -> Callable[..., Any]:
    """A bias by distance: aux_tensors[0] is [H, D + 1] flattened (float32), the bias of distances 0 .. D - 1 and,
    in its last column, of every distance from D on (T5's last bucket); keys after the query (masked by the causal
    call) read distance 0."""
    import cutlass
    import cutlass.cute as cute

    @cute.jit
    def mod(scores, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        table = aux_tensors[0]
        distance = q_idx + (seqlen_info.seqlen_k - seqlen_info.seqlen_q) - kv_idx
        distance = cute.where(operator.lt(distance, cute.full_like(distance, 0)), cute.full_like(distance, 0),
                              distance)
        distance = cute.where(operator.gt(distance, cute.full_like(distance, D)), cute.full_like(distance, D),
                              distance)
        index = cute.make_rmem_tensor(1, cutlass.Int32)
        index.store(h_idx * cute.full_like(h_idx, D + 1) + distance)
        bias = cute.make_rmem_tensor(1, cutlass.Float32)
        bias[0] = table[index[0]]
        return scores + bias.load()

    return mod
