from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .. import ops


class Linear(nn.Linear):
    """A drop-in nn.Linear whose bias and optional activation run in the GEMM epilogue.

    Same constructor, parameters (weight (out, in), bias (out)) and state_dict
    as nn.Linear, plus ``activation=`` (None, "gelu_tanh", "gelu", "relu", "silu").
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 activation: Optional[str] = None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        ops.check_activation(activation, "nn.Linear")  # unknown names refused at construction
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias, self.activation)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", activation={self.activation!r}"
