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
    # the kind of the norm this module replaced in a swap (None: it replaced none, e.g. a Peri-LN output norm): what
    # a DyT's calibration fits its α to (norm/fit.py)
    replaced: str | None = None

    def __init__(self, shape: int | tuple[int, ...], eps: float, offset: float = 0.0, bias: bool = False,
                 affine: bool = True, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (shape,)
        self.normalized_shape = shape
        self.eps = float(eps)
        self.offset = float(offset)
        init = 0.0 if offset else 1.0
        self.weight = nn.Parameter(torch.full(shape, init, dtype=dtype, device=device)) if affine else None
        self.bias = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device)) if bias else None

    def _scale(self) -> torch.Tensor | None:
        if self.weight is None:
            return None
        return self.weight.float() + self.offset if self.offset else self.weight.float()

    def _affine(self, x: torch.Tensor) -> torch.Tensor:
        scale = self._scale()
        if scale is not None:
            x = x * scale
        if self.bias is not None:
            x = x + self.bias.float()
        return x

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """The norm without its affine, in float32 (what a calibration fits the weight and bias over)."""
        raise NotImplementedError

    def sibling(self) -> NormModule:
        """A new norm of the same kind, shape, eps, offset, dtype and device, with a unit scale and a zero bias (where
        this one has a weight / bias): a Peri-LN output norm beside this input norm."""
        like = next(iter(self.parameters()), None)
        new = type(self)(self.normalized_shape, self.eps, offset=self.offset, bias=self.bias is not None,
                         affine=self.weight is not None, dtype=None if like is None else like.dtype,
                         device=None if like is None else like.device)
        return new.train(self.training)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, offset={self.offset}, bias={self.bias is not None}"


class RMSNorm(NormModule):
    """x / sqrt(mean(x²) + eps) · (offset + weight) [+ bias]."""

    kind = "rmsnorm"

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._affine(self.normalize(x)).to(x.dtype)


class LayerNorm(NormModule):
    """(x − mean) / sqrt(var + eps) · (offset + weight) [+ bias]."""

    kind = "layernorm"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel (about 3x faster than the composite ops on CPU, forward + backward)
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, self._scale(), bias, self.eps).to(x.dtype)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.normalized_shape, None, None, self.eps)


class DyT(NormModule):
    """Dynamic Tanh (Zhu et al., "Transformers without Normalization", CVPR 2025), in place of a norm:
    tanh(α · x) · (offset + weight) + bias, with α one learnable scalar per module. No statistics: each element is
    squashed on its own. `eps` is kept (unused) so that a later swap back gets the replaced norm's."""

    kind = "dyt"
    ALPHA0 = 0.5  # the paper's default initial α (what a swap without calibration, or a fresh model, starts from)

    def __init__(self, shape: int | tuple[int, ...], eps: float, offset: float = 0.0, bias: bool = True,
                 affine: bool = True, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 alpha0: float = ALPHA0) -> None:
        super().__init__(shape, eps, offset, bias, affine, dtype, device)
        self.alpha = nn.Parameter(torch.full((), float(alpha0), dtype=dtype, device=device))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.alpha.float() * x.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._affine(self.normalize(x)).to(x.dtype)

    def sibling(self) -> NormModule:
        new = DyT(self.normalized_shape, self.eps, offset=self.offset, bias=self.bias is not None,
                  affine=self.weight is not None, dtype=self.alpha.dtype, device=self.alpha.device)
        return new.train(self.training)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, alpha={float(self.alpha):.4g}"


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._affine(self.normalize(x)).to(x.dtype)

    def normalize(self, x):
        """(x − mean) / sqrt(var + eps) with the statistics forward() uses (updating the running ones in training)."""
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
        return (h - mean) * torch.rsqrt(var + self.eps)

    def sibling(self) -> NormModule:
        new = super().sibling()
        new.momentum, new.padding = self.momentum, self.padding  # the model's one record of padding
        return new

    def extra_repr(self) -> str:
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


def build(cls: type, shape: int | tuple[int, ...], eps: float, offset: float, weight: torch.Tensor | None,
          bias: torch.Tensor | None, like: torch.Tensor) -> NormModule:
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
