"""Modules that hold parameters and call coda.ops; state_dicts load from plain PyTorch."""

from .linear import Linear
from .mlp import MLP

__all__ = ["Linear", "MLP"]
