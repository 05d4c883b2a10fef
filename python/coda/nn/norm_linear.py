from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .. import ops
from ._fold import FoldedNorm


def make_norm(normalization: str, size: int, eps: Optional[float], device=None, dtype=None) -> nn.Module:
    """nn.LayerNorm or nn.RMSNorm, so their state_dicts load as they are. eps
    None is each norm's own default (1e-5; nn.RMSNorm's None: the dtype's
    machine epsilon)."""
    if ops.check_normalization(normalization, "nn"):
        return nn.LayerNorm(size, eps=1e-5 if eps is None else eps, device=device, dtype=dtype)
    return nn.RMSNorm(size, eps=eps, device=device, dtype=dtype)


def norm_gamma(weight: torch.Tensor, zero_centered: bool) -> torch.Tensor:
    """The scale a norm applies: its weight, or 1 + weight where zero-centered (added in float32, rounded once)."""
    return (weight.float() + 1).to(weight.dtype) if zero_centered else weight


def norm_eps(norm: nn.Module) -> Optional[float]:
    """A norm module's eps: torch's norms' .eps, or Hugging Face's RMSNorms' .variance_epsilon."""
    return norm.eps if hasattr(norm, "eps") else norm.variance_epsilon


class NormInFront(nn.Module):
    """What LayerNormLinear and LayerNormMLP share: a norm in front of a
    Linear whose weight the norm is folded into, an activation name, and the
    fold kept for inference (fold_weights)."""

    def __init__(self, size: int, eps: Optional[float], normalization: str, activation: Optional[str], device,
                 dtype):
        super().__init__()
        ops.check_activation(activation, "nn")
        self.normalization = normalization
        self.activation = activation
        self.norm = make_norm(normalization, size, eps, device, dtype)
        self._fold = FoldedNorm(self)

    def norm_kind(self) -> str:
        return "LayerNorm" if isinstance(self.norm, nn.LayerNorm) else "RMSNorm"

    def norm_args(self):
        """(normalization, weight, bias, eps) of the norm, as the folding ops take them."""
        if isinstance(self.norm, nn.LayerNorm):
            return "LayerNorm", self.norm.weight, self.norm.bias, self.norm.eps
        return "RMSNorm", self.norm.weight, None, self.norm.eps

    def first_linear(self) -> nn.Linear:
        raise NotImplementedError

    def fold_inputs(self):
        _, weight, bias, _ = self.norm_args()
        linear = self.first_linear()
        return linear.weight, weight, bias, linear.bias

    def fold_weights(self):
        """Fold the norm into the next weight once and keep it for forwards
        that need no gradient (inference); see coda/nn/_fold.py. Returns self."""
        self._fold.fold(self)
        return self

    def unfold_weights(self):
        """Drop the kept fold (forwards fold afresh). Returns self."""
        self._fold.clear()
        return self

    def folded_for(self, x: torch.Tensor):
        return self._fold.for_forward(self, x)

    def extra_repr(self) -> str:
        return f"normalization={self.normalization!r}, activation={self.activation!r}"


class LayerNormLinear(NormInFront):
    """Norm(x) -> Linear (-> activation), in the style of Transformer Engine's LayerNormLinear.

    The norm is folded into the GEMM (coda.ops.layernorm_linear / rmsnorm_linear):
    the normalized input is never written. Parameters live in ``norm`` (an
    nn.LayerNorm or nn.RMSNorm) and ``linear`` (an nn.Linear), so a plain
    pair's state_dicts load into them as they are. ``forward(x, stats=None)``
    takes the per-row (mean, rstd) of x that coda.ops.linear_residual returns,
    to skip computing them. eps None: the norm's own default.
    """

    def __init__(self, in_features: int, out_features: int, eps: Optional[float] = None, bias: bool = True,
                 normalization: str = "LayerNorm", activation: Optional[str] = None, device=None, dtype=None):
        super().__init__(in_features, eps, normalization, activation, device, dtype)
        self.linear = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)

    def first_linear(self) -> nn.Linear:
        return self.linear

    def forward(self, x: torch.Tensor, stats: Optional[torch.Tensor] = None) -> torch.Tensor:
        kind, weight, bias, eps = self.norm_args()
        folded = self.folded_for(x)
        if kind == "LayerNorm":
            return ops.layernorm_linear(x, weight, bias, self.linear.weight, self.linear.bias, eps, self.activation,
                                        stats, folded)
        return ops.rmsnorm_linear(x, weight, self.linear.weight, self.linear.bias, eps, self.activation, stats,
                                  folded)


class RMSNormLinear(LayerNormLinear):
    """LayerNormLinear with normalization="RMSNorm" (LLaMA-style): no bias by
    default, eps None as nn.RMSNorm's."""

    def __init__(self, in_features: int, out_features: int, eps: Optional[float] = None, bias: bool = False,
                 activation: Optional[str] = None, device=None, dtype=None):
        super().__init__(in_features, out_features, eps=eps, bias=bias, normalization="RMSNorm",
                         activation=activation, device=device, dtype=dtype)
