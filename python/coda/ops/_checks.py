"""The argument checks of the public ops: the only ones on the Python side.
Each error names the argument, what was expected and what came."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

from .. import _activations

# The activations a GLU's gate takes (the kernels' SiLU and GELUs).
GATE_ACTIVATIONS = ("silu", "swish", "gelu_tanh", "gelu_pytorch_tanh", "gelu_new", "gelu", "gelu_erf")


def _shape(t: Tensor) -> tuple:
    return tuple(t.shape)


def x_input(x, op: str, name: str = "x") -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"coda.{op}: {name} must be a Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(f"coda.{op}: {name} must have at least one dimension (..., features), got a scalar")
    if not x.is_floating_point():
        raise TypeError(f"coda.{op}: {name} must be a floating-point tensor, got {x.dtype}")


def like(name: str, t: Tensor, x: Tensor, op: str) -> None:
    """t has x's dtype and device (under autocast the ops cast first)."""
    if isinstance(t, Tensor) and t.dtype is x.dtype and t.is_cuda and x.is_cuda and t.get_device() == x.get_device():
        return  # the kernels' case, without building two torch.device objects
    if not isinstance(t, Tensor):
        raise TypeError(f"coda.{op}: {name} must be a Tensor, got {type(t).__name__}")
    if t.dtype != x.dtype:
        raise TypeError(f"coda.{op}: {name} has dtype {t.dtype}, expected {x.dtype} (the dtype of x; "
                        f"under torch.autocast the op casts both)")
    if t.device != x.device:
        raise ValueError(f"coda.{op}: {name} is on {t.device}, expected {x.device} (the device of x)")


def weight(name: str, w: Tensor, in_features: int, op: str, input_name: str, input_shape: Sequence[int]) -> None:
    """w is (out_features, in_features) for an input whose last dimension is
    in_features; a mismatch blames the input, which is what usually is wrong."""
    if not isinstance(w, Tensor):
        raise TypeError(f"coda.{op}: {name} must be a Tensor, got {type(w).__name__}")
    if w.dim() != 2:
        raise ValueError(f"coda.{op}: {name} must be 2-D (out_features, in_features), got shape {_shape(w)}")
    if w.shape[1] != in_features:
        raise ValueError(f"coda.{op}: {input_name} has shape {tuple(input_shape)}, but {name} {_shape(w)} takes "
                         f"{w.shape[1]} input features: expected {input_name} of shape (..., {w.shape[1]})")


def vector(name: str, t: Optional[Tensor], n: int, op: str, what: str = "") -> None:
    if t is None:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"coda.{op}: {name} must be a Tensor or None, got {type(t).__name__}")
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"coda.{op}: {name} must have shape ({n},){what}, got {_shape(t)}")


def matrix_like(name: str, t, shape: Sequence[int], op: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"coda.{op}: {name} must be a Tensor, got {type(t).__name__}")
    if _shape(t) != tuple(shape):
        raise ValueError(f"coda.{op}: {name} must have shape {tuple(shape)}, got {_shape(t)}")


NORMALIZATIONS = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}


def gate_code(activation: Optional[str], op: str) -> int:
    """The kernel code of a GLU gate's activation name."""
    key = activation.lower() if isinstance(activation, str) else activation
    if key not in GATE_ACTIVATIONS:
        raise ValueError(f"coda.{op}: activation must be one of {list(GATE_ACTIVATIONS)} (the gate's), "
                         f"got {activation!r}")
    return _activations.code(key)


def check_activation(activation: Optional[str], op: str = "ops", gated: bool = False) -> None:
    """Raises ValueError naming `op` unless coda's kernels take `activation` (None: identity), or with
    `gated` the activation of a GLU's gate; for modules and patches to refuse a name when they are built."""
    if gated:
        gate_code(activation, op)
        return
    try:
        _activations.code(activation)
    except ValueError as e:
        raise ValueError(f"coda.{op}: {str(e).removeprefix('coda: ')}") from None


def layernorm(normalization, op: str = "ops") -> bool:
    """True for 'LayerNorm', False for 'RMSNorm' (any case); ValueError naming `op` otherwise
    (public as coda.ops.check_normalization)."""
    key = normalization.lower() if isinstance(normalization, str) else normalization
    if key not in NORMALIZATIONS:
        raise ValueError(f"coda.{op}: normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")
    return key == "layernorm"


def eps_of(eps: Optional[float], layernorm: bool, x: Tensor, op: str) -> float:
    """LayerNorm's default 1e-5; RMSNorm's None is the dtype's machine epsilon, as nn.RMSNorm has it."""
    if eps is None:
        return 1e-5 if layernorm else torch.finfo(x.dtype).eps
    if not isinstance(eps, (int, float)) or not eps >= 0 or math.isinf(eps):
        raise ValueError(f"coda.{op}: eps must be a finite float >= 0 or None, got {eps!r}")
    return float(eps)


def stats(s: Optional[Tensor], x: Tensor, op: str) -> None:
    if s is None:
        return
    want = (*x.shape[:-1], 2)
    if not isinstance(s, Tensor) or _shape(s) != want or s.dtype != torch.float32:
        got = f"{s.dtype} {_shape(s)}" if isinstance(s, Tensor) else type(s).__name__
        raise ValueError(f"coda.{op}: stats must be a float32 tensor of shape {want} (mean, rstd per row, as "
                         f"linear_residual returns them), got {got}")
    if s.device != x.device:
        raise ValueError(f"coda.{op}: stats is on {s.device}, expected {x.device} (the device of x)")
