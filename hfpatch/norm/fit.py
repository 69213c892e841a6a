"""hfpatch.calibrate: fit what a patch put into a pretrained model to the model it replaced, on calibration batches.

- norm="batchnorm": the running statistics (norm/batchnorm.calibrate).
- norm="dyt": each DyT's α, fit to the norm it replaced. The swap keeps that norm's γ and β, so DyT computes
  γ·tanh(α·x) + β where the norm computed γ·n(x) + β, and the fit minimises, over the tokens t and channels c of the
  module's input x,

      Σ_t,c γ_c² · (tanh(α·x_tc) − n(x)_tc)²          (β cancels)

  with n the replaced norm without its affine (RMSNorm: x / rms(x); LayerNorm: (x − mean) / std, its eps): a 1-D
  search over log α (a grid from 1e-3 to 1e4, then a golden-section search around its best point). A DyT that
  replaced no norm (a Peri-LN output norm) keeps its α.
- placement="peri": each output norm O's scale γ_c (and bias β_c where O has one), so that O reproduces the
  sublayer output y it normalises: least squares per channel, in closed form,

      min Σ_t (γ_c·z_tc + β_c − y_tc)²,   z = O without its affine, applied to y.

Each module is fit when the forward reaches it, from its input on every batch so far, before it computes its
output, so that each one sees the input the modules fit before it give (as BatchNorm's running statistics do).
A DyT fit keeps at most ROWS tokens of each batch (a seeded sample); the output norms' sums cover every token.
Nothing else changes, and a calibration that fails or is interrupted leaves every module as it was.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..adapters.base import get_path
from ..adapters.blocks import SPEC_ATTR
from ..adapters.probe import restore_modes
from .batchnorm import calibrate as calibrate_batchnorm
from .batchnorm import model_batches
from .kinds import NORMS
from .modules import BatchNorm, DyT, NormModule

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ROWS = 256  # tokens of each batch a DyT's α is fit on (a seeded sample where there are more)
ALPHA_RANGE = (1e-3, 1e4)  # where the α search starts: a grid over log α, refined around its best point
GRID, GOLDEN_STEPS = 36, 30


def output_norms(model: nn.Module) -> list[NormModule]:
    """The Peri-LN output norms of `model` (those the peri block forms run), in the order of the blocks."""
    out = []
    for block in model.modules():
        spec = getattr(block, SPEC_ATTR, None)
        for path in (spec.outputs or ()) if spec is not None else ():
            out.append(get_path(block, path))
    return out


def fitted_dyts(model: nn.Module) -> list[DyT]:
    """The DyTs whose α a calibration fits: those that replaced a norm."""
    return [m for m in model.modules() if isinstance(m, DyT) and m.replaced is not None]


def calibrate(model: PreTrainedModel, batches: Any = None) -> int:
    """Calibrate every BatchNorm, DyT and Peri-LN output norm of `model` on `batches` (see the module's docstring;
    `batches` as norm/batchnorm.calibrate takes them). Returns the number of norms calibrated."""
    batchnorms = [m for m in model.modules() if isinstance(m, BatchNorm)]
    dyts, outputs = fitted_dyts(model), output_norms(model)
    if not (batchnorms or dyts or outputs):
        raise ValueError("calibrate: the model has no BatchNorm, no DyT that replaced a norm and no Peri-LN output "
                         "norm: nothing to calibrate (patch it with norm='batchnorm', norm='dyt' or "
                         "placement='peri' first)")
    inputs = model_batches(model, batches)  # checked before anything changes
    modules = {id(m): m for m in batchnorms + dyts + outputs}
    saved = {key: {k: t.detach().clone() for k, t in m.state_dict().items()} for key, m in modules.items()}
    try:
        if batchnorms:
            calibrate_batchnorm(model, inputs)
        if dyts or outputs:
            _fit(model, inputs, dyts, outputs)
    except BaseException:
        with torch.no_grad():
            for key, m in modules.items():
                for name, t in m.state_dict().items():
                    t.copy_(saved[key][name])
        raise
    return len(modules)


@torch.no_grad()
def _fit(model: PreTrainedModel, inputs: list[dict], dyts: list[DyT], outputs: list[NormModule]) -> None:
    fits = [AlphaFit(m, seed=i) for i, m in enumerate(dyts)] + [AffineFit(m) for m in outputs]
    modes = [(m, m.training) for m in model.modules()]
    hooks = [f.module.register_forward_pre_hook(f.hook) for f in fits]
    model.eval()
    try:
        for batch in inputs:
            model(**batch, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
        restore_modes(modes)


class AlphaFit:
    """A DyT's α, fit to the norm it replaced on the inputs it has seen (a sample of ROWS tokens per batch)."""

    def __init__(self, module: DyT, seed: int) -> None:
        self.module = module
        self.generator = torch.Generator().manual_seed(seed)
        self.x: list[torch.Tensor] = []
        self.target: list[torch.Tensor] = []
        scale = module._scale()
        self.weight = None if scale is None else scale.detach().float().pow(2)  # γ_c²
        self.reference = replaced_norm(module)

    def hook(self, module: Any, args: tuple) -> None:
        x = args[0].detach().float().reshape(-1, args[0].shape[-1])
        if x.shape[0] > ROWS:
            x = x[torch.randperm(x.shape[0], generator=self.generator)[:ROWS].to(x.device)]
        self.x.append(x)
        self.target.append(self.reference.normalize(x))
        with torch.no_grad():
            module.alpha.fill_(fit_alpha(torch.cat(self.x), torch.cat(self.target), self.weight))


def replaced_norm(module: DyT) -> NormModule:
    """A module computing the norm `module` replaced, without its affine (same eps): the α fit's target."""
    kind = module.replaced
    if kind is None:
        raise ValueError("calibrate: this DyT replaced no norm, so there is nothing to fit its α to")
    return NORMS[kind].module(module.normalized_shape, module.eps, affine=False).eval()


def alpha_loss(alpha: float, x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None) -> float:
    """Σ γ_c² (tanh(α·x) − target)² over the rows of x."""
    err = (torch.tanh(alpha * x) - target).pow(2)
    return float((err.sum(0) * weight).sum() if weight is not None else err.sum())


def fit_alpha(x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None) -> float:
    """The α > 0 minimising alpha_loss: the best point of a log grid, refined by golden section between its
    neighbours."""
    lo, hi = (math.log(a) for a in ALPHA_RANGE)
    grid = [lo + (hi - lo) * i / (GRID - 1) for i in range(GRID)]
    losses = [alpha_loss(math.exp(u), x, target, weight) for u in grid]
    best = min(range(GRID), key=losses.__getitem__)
    a, b = grid[max(best - 1, 0)], grid[min(best + 1, GRID - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = alpha_loss(math.exp(c), x, target, weight), alpha_loss(math.exp(d), x, target, weight)
    for _ in range(GOLDEN_STEPS):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = alpha_loss(math.exp(c), x, target, weight)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = alpha_loss(math.exp(d), x, target, weight)
    return math.exp((a + b) / 2)


class AffineFit:
    """An output norm's scale and bias, fit per channel by least squares to the output it normalises (sums over
    every token seen)."""

    def __init__(self, module: NormModule) -> None:
        self.module = module
        self.sums: dict[str, torch.Tensor] = {}

    def hook(self, module: Any, args: tuple) -> None:
        y = args[0].detach().float().reshape(-1, args[0].shape[-1])
        z = module.normalize(y)
        add = {"n": torch.tensor(float(y.shape[0])), "z": z.sum(0), "y": y.sum(0), "zz": (z * z).sum(0),
               "zy": (z * y).sum(0)}
        self.sums = {k: self.sums[k] + v for k, v in add.items()} if self.sums else add
        gamma, beta = fit_affine(self.sums, with_bias=module.bias is not None)
        with torch.no_grad():
            if module.weight is not None:
                module.weight.copy_(gamma - module.offset)
            if module.bias is not None:
                module.bias.copy_(beta)


def fit_affine(s: dict, with_bias: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(γ, β) per channel minimising Σ (γ·z + β − y)² from the sums n, Σz, Σy, Σz², Σzy (β = 0 without a bias)."""
    if not with_bias:
        return s["zy"] / s["zz"].clamp_min(1e-12), torch.zeros_like(s["zy"])
    n = s["n"]
    var = s["zz"] / n - (s["z"] / n) ** 2
    cov = s["zy"] / n - (s["z"] / n) * (s["y"] / n)
    gamma = torch.where(var > 1e-12, cov / var.clamp_min(1e-12), torch.zeros_like(cov))
    return gamma, s["y"] / n - gamma * s["z"] / n
