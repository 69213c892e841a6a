"""Function-preserving LayerNorm → RMSNorm (SliceGPT's computational invariance, Ashkboos et al. 2024), as pure
functions on tensors.

LayerNorm(x) = γ ⊙ (x − mean x) / sqrt(var x + ε) + β. If every vector the residual stream ever holds has zero mean,
then var x = mean(x²) and LayerNorm(x) = γ ⊙ RMSNorm(x) + β: RMSNorm with unit weight, followed by an affine map
that folds into the linear layers reading the norm (W' = W diag γ, b' = b + W β). The residual stream is a sum of
embeddings and sublayer outputs, so it is zero-mean once each of those writers is centred (its output projected
onto the zero-mean subspace: subtract the mean over the hidden dimension). Centring changes nothing the model
computes, because in a pre-norm model every read of the stream goes through a LayerNorm, which subtracts the mean
anyway.

Linear layers come in two layouts: nn.Linear stores W as [out, in], GPT-2's Conv1D as [in, out]. Everything is
computed in float64 and cast back.
"""

from __future__ import annotations

import torch


def centre_rows(table: torch.Tensor) -> torch.Tensor:
    """Embedding tables: each row (one token's / position's vector) minus its mean."""
    t = table.double()
    return (t - t.mean(-1, keepdim=True)).to(table.dtype)


def centre_output(weight: torch.Tensor, bias: torch.Tensor | None,
                  conv1d: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A linear layer whose output is added to the residual stream: make every output zero-mean."""
    w = weight.double()
    out_dim = 1 if conv1d else 0
    w = w - w.mean(out_dim, keepdim=True)
    if bias is None:
        return w.to(weight.dtype), None
    return w.to(weight.dtype), (bias.double() - bias.double().mean()).to(bias.dtype)


def fold_affine(weight: torch.Tensor, bias: torch.Tensor | None, gamma: torch.Tensor | None,
                beta: torch.Tensor | None, conv1d: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear layer reading γ ⊙ n + β: return W', b' with W'n + b' = W(γ ⊙ n + β) + b. b' always exists."""
    w = weight.double()
    if conv1d:  # y = n @ W + b, W [in, out]
        shift = 0.0 if beta is None else beta.double() @ w
        if gamma is not None:
            w = gamma.double()[:, None] * w
        out_features = weight.shape[1]
    else:  # y = W n + b, W [out, in]
        shift = 0.0 if beta is None else w @ beta.double()
        if gamma is not None:
            w = w * gamma.double()[None, :]
        out_features = weight.shape[0]
    b = torch.zeros(out_features, dtype=torch.float64, device=weight.device) if bias is None else bias.double()
    b = b + shift
    return w.to(weight.dtype), b.to(weight.dtype if bias is None else bias.dtype)
