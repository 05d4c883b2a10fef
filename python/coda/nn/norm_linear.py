from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .. import _activations, ops


def make_norm(normalization: str, size: int, eps: float, device=None, dtype=None) -> nn.Module:
    """nn.LayerNorm or nn.RMSNorm, so their state_dicts load as they are."""
    kind = ops._norm_kind(normalization, "nn")
    if kind == "layernorm":
        return nn.LayerNorm(size, eps=eps, device=device, dtype=dtype)
    return nn.RMSNorm(size, eps=eps, device=device, dtype=dtype)


class NormInFront(nn.Module):
    """What LayerNormLinear and LayerNormMLP share: a norm in front, an activation name."""

    def __init__(self, size: int, eps: float, normalization: str, activation: Optional[str], device, dtype):
        super().__init__()
        _activations.code(activation)
        self.normalization = normalization
        self.activation = activation
        self.norm = make_norm(normalization, size, eps, device, dtype)

    def norm_args(self, x: torch.Tensor):
        """(normalization, weight, bias, eps) of the norm, as the folding ops take them."""
        if isinstance(self.norm, nn.LayerNorm):
            return "LayerNorm", self.norm.weight, self.norm.bias, self.norm.eps
        eps = self.norm.eps if self.norm.eps is not None else torch.finfo(x.dtype).eps
        return "RMSNorm", self.norm.weight, None, eps

    def extra_repr(self) -> str:
        return f"normalization={self.normalization!r}, activation={self.activation!r}"


class LayerNormLinear(NormInFront):
    """Norm(x) -> Linear (-> activation), in the style of Transformer Engine's LayerNormLinear.

    The norm is folded into the GEMM (coda.ops.layernorm_linear / rmsnorm_linear):
    the normalized input is never written. Parameters live in ``norm`` (an
    nn.LayerNorm or nn.RMSNorm) and ``linear`` (an nn.Linear), so a plain
    pair's state_dicts load into them as they are. ``forward(x, stats=None)``
    takes the per-row (mean, rstd) of x that coda.ops.linear_residual returns,
    to skip computing them.
    """

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, bias: bool = True,
                 normalization: str = "LayerNorm", activation: Optional[str] = None, device=None, dtype=None):
        super().__init__(in_features, eps, normalization, activation, device, dtype)
        self.linear = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, stats: Optional[torch.Tensor] = None) -> torch.Tensor:
        kind, weight, bias, eps = self.norm_args(x)
        if kind == "LayerNorm":
            return ops.layernorm_linear(x, weight, bias, self.linear.weight, self.linear.bias, eps, self.activation,
                                        stats)
        return ops.rmsnorm_linear(x, weight, self.linear.weight, self.linear.bias, eps, self.activation, stats)


class RMSNormLinear(LayerNormLinear):
    """LayerNormLinear with normalization="RMSNorm" (LLaMA-style), eps 1e-6 by default."""

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-6, bias: bool = False,
                 activation: Optional[str] = None, device=None, dtype=None):
        super().__init__(in_features, out_features, eps=eps, bias=bias, normalization="RMSNorm",
                         activation=activation, device=device, dtype=dtype)
