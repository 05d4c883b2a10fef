"""Modules that hold parameters and call coda.ops; state_dicts load from plain PyTorch."""

from .linear import Linear
from .mlp import MLP
from .norm_linear import LayerNormLinear, RMSNormLinear
from .norm_mlp import LayerNormMLP

__all__ = ["Linear", "MLP", "LayerNormLinear", "RMSNormLinear", "LayerNormMLP"]
