from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .. import ops


class MLP(nn.Module):
    """The Transformer MLP, fc2(act(fc1(x))) (+ residual), as two fused GEMMs.

    Parameters live in two nn.Linear submodules, ``fc1`` (hidden -> ffn) and
    ``fc2`` (ffn -> hidden), so a state_dict with keys fc1.weight, fc1.bias,
    fc2.weight, fc2.bias (OPT, CLIP, ViT, Phi) loads as it is.

    Args mirror Transformer Engine's LayerNormMLP where they overlap:
    ``hidden_size``, ``ffn_hidden_size``, ``bias``, ``activation``.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, bias: bool = True,
                 activation: Optional[str] = "gelu_tanh", device=None, dtype=None):
        super().__init__()
        ops.check_activation(activation, "nn.MLP")
        self.activation = activation
        self.fc1 = nn.Linear(hidden_size, ffn_hidden_size, bias=bias, device=device, dtype=dtype)
        self.fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        return ops.mlp(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias,
                       activation=self.activation, residual=residual)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"
