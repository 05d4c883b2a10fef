"""Modules that hold parameters and call coda.ops; state_dicts load from plain PyTorch."""

from torch import nn

from ._parts import FusedPart
from .glu_mlp import SwiGLUMLP
from .linear import Linear
from .lm_head import LMHead, causal_lm_loss
from .mlp import MLP
from .norm_linear import LayerNormLinear, NormInFront, RMSNormLinear, norm_eps, norm_gamma
from .norm_mlp import LayerNormMLP
from .rope import RMSNormQKVRoPE

__all__ = ["Linear", "MLP", "SwiGLUMLP", "LayerNormLinear", "RMSNormLinear", "LayerNormMLP", "RMSNormQKVRoPE",
           "LMHead", "FusedPart", "fold_weights", "unfold_weights", "causal_lm_loss", "norm_gamma", "norm_eps"]


def fold_weights(model: nn.Module) -> nn.Module:
    """Fold every norm into its next weight once, for inference (see coda/nn/_fold.py). Returns model."""
    for m in model.modules():
        if isinstance(m, NormInFront):
            m.fold_weights()
    return model


def unfold_weights(model: nn.Module) -> nn.Module:
    """Drop the folds fold_weights kept. Returns model."""
    for m in model.modules():
        if isinstance(m, NormInFront):
            m.unfold_weights()
    return model
