from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .. import ops
from .norm_linear import NormInFront


class LayerNormMLP(NormInFront):
    """Norm(x) -> fc1 -> activation -> fc2 (+ residual), like Transformer Engine's LayerNormMLP.

    Parameters: ``norm`` (nn.LayerNorm or nn.RMSNorm), ``fc1``, ``fc2``
    (nn.Linear). Runs as coda.ops.norm_mlp: the norm folded into fc1, bias,
    activation and residual in the epilogues, forward and backward.
    ``forward(x, residual=x)`` is the pre-norm block x + MLP(Norm(x));
    ``stats`` takes x's row statistics (e.g. from coda.ops.linear_residual) and
    ``return_stats=True`` returns ``(y, stats of y)`` for the next norm of
    this kind and eps.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: Optional[float] = None, bias: bool = True,
                 normalization: str = "LayerNorm", activation: Optional[str] = "gelu_tanh", device=None,
                 dtype=None):
        super().__init__(hidden_size, eps, normalization, activation, device, dtype)
        self.fc1 = nn.Linear(hidden_size, ffn_hidden_size, bias=bias, device=device, dtype=dtype)
        self.fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias=bias, device=device, dtype=dtype)

    def first_linear(self) -> nn.Linear:
        return self.fc1

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None,
                stats: Optional[torch.Tensor] = None, return_stats: bool = False):
        kind, weight, bias, eps = self.norm_args()
        return ops.norm_mlp(x, weight, bias, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias,
                            kind, eps, self.activation, residual, stats, self.folded_for(x), return_stats)
