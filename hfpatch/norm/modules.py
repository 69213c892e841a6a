"""hfpatch's own norm modules, and a reader for the norm modules of every supported family.

The modules compute their statistics and the affine in float32 and cast the result back to the input dtype (as
every RMSNorm of the supported families does, and as torch's LayerNorm kernels accumulate). `offset` keeps Gemma's
parametrization: the scale is `offset + weight` (Gemma stores w and multiplies by 1 + w).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..adapters.base import class_key


class NormModule(nn.Module):
    kind = ""  # the key of its record in norm/kinds.NORMS

    def __init__(self, shape, eps, offset=0.0, bias=False, affine=True, dtype=None, device=None):
        super().__init__()
        shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (shape,)
        self.normalized_shape = shape
        self.eps = float(eps)
        self.offset = float(offset)
        init = 0.0 if offset else 1.0
        self.weight = nn.Parameter(torch.full(shape, init, dtype=dtype, device=device)) if affine else None
        self.bias = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device)) if bias else None

    def _scale(self):
        if self.weight is None:
            return None
        return self.weight.float() + self.offset if self.offset else self.weight.float()

    def _affine(self, x):
        if self.weight is not None:
            x = x * self._scale()
        if self.bias is not None:
            x = x + self.bias.float()
        return x

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, offset={self.offset}, bias={self.bias is not None}"


class RMSNorm(NormModule):
    """x / sqrt(mean(x²) + eps) · (offset + weight) [+ bias]."""

    kind = "rmsnorm"

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self._affine(h).to(x.dtype)


class LayerNorm(NormModule):
    """(x − mean) / sqrt(var + eps) · (offset + weight) [+ bias]."""

    kind = "layernorm"

    def forward(self, x):
        # torch's fused kernel (about 3x faster than the composite ops on CPU, forward + backward)
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, self._scale(), bias, self.eps).to(x.dtype)


class BatchNorm(NormModule):
    """Each channel normalised over the batch and the sequence, as torch.nn.BatchNorm1d does over the tokens that
    are not padding: (x − mean) / sqrt(var + eps) · (offset + weight) [+ bias].

    Training: the statistics of this batch's real tokens (biased variance), and running statistics updated with
    `momentum` (unbiased variance, as torch does). eval(): the running statistics, or the batch's own ones while
    `use_batch_statistics` is set (norm/batchnorm.batch_statistics; the running ones are then left alone). Which
    tokens are real comes from `padding` (norm/batchnorm.PaddingMask, filled by the model's forward from its
    attention mask); None: every token counts. The channel is the last dimension; the first two are batch and
    sequence (QK norms see [batch, seq, heads, head_dim]: heads count as more samples)."""

    kind = "batchnorm"

    def __init__(self, shape, eps, offset=0.0, bias=False, affine=True, dtype=None, device=None, momentum=0.1):
        super().__init__(shape, eps, offset, bias, affine, dtype, device)
        self.momentum = float(momentum)
        self.register_buffer("running_mean", torch.zeros(self.normalized_shape, dtype=dtype, device=device))
        self.register_buffer("running_var", torch.ones(self.normalized_shape, dtype=dtype, device=device))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device))
        self.padding = None
        self.use_batch_statistics = False

    def forward(self, x):
        h = x.float()
        if self.training or self.use_batch_statistics:
            rows = h.reshape(-1, h.shape[-1])
            keep = None if self.padding is None else self.padding.keep(h)
            rows = rows if keep is None else rows[keep]
            if rows.shape[0] < 2:
                raise ValueError(f"batchnorm needs more than one real token per channel to compute batch statistics, "
                                 f"got {rows.shape[0]} (input {tuple(x.shape)}); evaluate with model.eval() to use "
                                 "the running statistics")
            mean, var = rows.mean(0), rows.var(0, unbiased=False)
            if self.training and not self.use_batch_statistics:
                n = rows.shape[0]
                with torch.no_grad():
                    m = self.momentum
                    self.running_mean.mul_(1 - m).add_(m * mean.detach().to(self.running_mean.dtype))
                    self.running_var.mul_(1 - m).add_(m * (var.detach() * n / (n - 1)).to(self.running_var.dtype))
                    self.num_batches_tracked.add_(1)
        else:
            mean, var = self.running_mean.float(), self.running_var.float()
        return self._affine((h - mean) * torch.rsqrt(var + self.eps)).to(x.dtype)

    def extra_repr(self):
        return f"{super().extra_repr()}, momentum={self.momentum}"


@dataclass
class NormParams:
    kind: str  # "rmsnorm" | "layernorm" | ... (a key of norm/kinds.NORMS)
    weight: torch.Tensor | None  # stored weight (the scale is offset + weight)
    bias: torch.Tensor | None
    eps: float
    offset: float

    def scale(self) -> torch.Tensor | None:
        """The effective elementwise scale, γ."""
        return None if self.weight is None else self.weight + self.offset


def read(module: nn.Module, classes: dict | None = None) -> NormParams:
    """What a norm module computes: ours, nn.LayerNorm, or a family's own norm class as inference read it
    numerically (`classes`: Adapter.norm_classes, "module.Class" -> NormClass)."""
    if isinstance(module, NormModule):
        return NormParams(module.kind, module.weight, module.bias, module.eps, module.offset)
    if isinstance(module, nn.LayerNorm):
        return NormParams("layernorm", module.weight, module.bias, module.eps, 0.0)
    cls = (classes or {}).get(class_key(module))
    if cls is None:
        raise ValueError(f"{type(module).__name__} is not a norm hfpatch recognised (it computes neither RMSNorm "
                         "nor LayerNorm on a probe input)")
    eps = getattr(module, cls.eps_attr) if cls.eps_attr else cls.eps
    return NormParams(cls.kind, getattr(module, "weight", None), getattr(module, "bias", None), float(eps),
                      cls.offset)


def build(cls: type, shape, eps: float, offset: float, weight, bias, like: torch.Tensor) -> NormModule:
    """A new norm module of class `cls` (one of the above) on `like`'s dtype and device, holding copies of `weight` /
    `bias` (None: no such parameter)."""
    m = cls(shape, eps, offset=offset, bias=bias is not None, affine=weight is not None, dtype=like.dtype,
            device=like.device)
    with torch.no_grad():
        if weight is not None:
            m.weight.copy_(weight)
        if bias is not None:
            m.bias.copy_(bias)
    return m
