"""Linear (+ activation) and the MLP: one GEMM per layer, the bias,
activation and residual in its epilogue, forward and backward.

Each op is one C++ op per direction (torch.ops.coda.linear / linear_backward,
mlp / mlp_backward, whose fakes are here) with its autograd in C++
(csrc/torch/autograd.h), and a reference path of plain torch code for what
has no kernel.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _activations, _kernels
from . import _checks
from ._common import autocast

__all__ = ["linear", "mlp"]


def _empty(like: Tensor, *shape: int) -> Tensor:
    return like.new_empty(shape if shape else (0,))


if _kernels.available():

    @torch.library.register_fake("coda::linear")
    def _(x, weight, bias, residual, activation, save_pre_act):
        out = (*x.shape[:-1], weight.shape[0])
        save = save_pre_act and activation != _activations.IDENTITY
        return x.new_empty(out), (x.new_empty(out) if save else _empty(x))

    @torch.library.register_fake("coda::linear_backward")
    def _(dy, x, weight, pre_act, activation, needs):
        return (x.new_empty(x.shape) if needs[0] else _empty(x), weight.new_empty(weight.shape) if needs[1] else _empty(x),
                x.new_empty(weight.shape[0]) if needs[2] else _empty(x))

    @torch.library.register_fake("coda::mlp")
    def _(x, w1, b1, w2, b2, residual, activation, save):
        m, f = math.prod(x.shape[:-1]), w1.shape[0]
        save_h = save and activation != _activations.IDENTITY
        return x.new_empty(*x.shape[:-1], w2.shape[0]), (x.new_empty(m, f) if save_h else _empty(x)), \
            (x.new_empty(m, f) if save else _empty(x))

    @torch.library.register_fake("coda::mlp_backward")
    def _(dy, x, w1, w2, h1, a1, activation, needs):
        e = x.new_empty
        return (e(x.shape) if needs[0] else e(0), e(w1.shape) if needs[1] else e(0), e(w1.shape[0]) if needs[2] else e(0),
                e(w2.shape) if needs[3] else e(0), e(w2.shape[0]) if needs[4] else e(0))


# ---- linear: y = act(x·Wᵀ + b) (+ residual)

def linear_reference(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: Optional[str] = None,
                     residual: Optional[Tensor] = None) -> Tensor:
    """act(x·weightᵀ + bias) (+ residual), unfused: the reference path and the tests' baseline."""
    y = _activations.apply(F.linear(x, weight, bias), _activations.code(activation))
    return y if residual is None else y + residual


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: Optional[str] = None) -> Tensor:
    """act(x·weightᵀ + bias) in one GEMM, its bias and activation in the epilogue.

    x: (..., in_features); weight: (out_features, in_features), nn.Linear's layout;
    bias: (out_features,) or None; activation: None, "gelu_tanh", "gelu" (erf),
    "relu" or "silu". Returns (..., out_features).
    """
    op = "linear"
    _checks.x_input(x, op)
    _checks.weight("weight", weight, x.shape[-1], op, "x", x.shape)
    _checks.vector("bias", bias, weight.shape[0], op, " (out_features of weight)")
    act = _activations.code(activation)
    x, weight, bias = autocast(x, weight, bias)
    _checks.like("weight", weight, x, op)
    if bias is not None:
        _checks.like("bias", bias, x, op)
    if not _kernels.use_kernels(op, x, _kernels.BF16_FP16, (x.shape[-1], weight.shape[0])):
        return linear_reference(x, weight, bias, activation)
    return torch.ops.coda.linear.default(x, weight, bias, None, act, False)[0]


# ---- mlp: y = fc2(act(fc1(x))) + residual

def mlp_reference(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor],
                  activation: Optional[str] = "gelu_tanh", residual: Optional[Tensor] = None) -> Tensor:
    """fc2(act(fc1(x))) (+ residual), unfused."""
    return linear_reference(linear_reference(x, w1, b1, activation), w2, b2, None, residual)


def mlp(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor],
        activation: Optional[str] = "gelu_tanh", residual: Optional[Tensor] = None) -> Tensor:
    """fc2(act(fc1(x))) + residual: two GEMMs, everything else in their epilogues.

    x: (..., D); w1: (F, D); b1: (F,) or None; w2: (E, F); b2: (E,) or None;
    residual: (..., E) or None. Returns (..., E). Forward: fc1's epilogue adds
    b1, applies act and keeps the pre-activation; fc2's adds b2 and the
    residual. Backward: fc2's dgrad epilogue applies act' and reduces db1.
    """
    op = "mlp"
    _checks.x_input(x, op)
    _checks.weight("w1", w1, x.shape[-1], op, "x", x.shape)
    _checks.vector("b1", b1, w1.shape[0], op, " (out_features of w1)")
    _checks.weight("w2", w2, w1.shape[0], op, "fc1's output (w1)", (*x.shape[:-1], w1.shape[0]))
    _checks.vector("b2", b2, w2.shape[0], op, " (out_features of w2)")
    out_shape = (*x.shape[:-1], w2.shape[0])
    if residual is not None:
        _checks.matrix_like("residual", residual, out_shape, op)
    act = _activations.code(activation)
    add_input = residual is x  # still x itself after autocast: the C++ autograd adds dy to dx once
    x, w1, b1, w2, b2, residual = autocast(x, w1, b1, w2, b2, residual)
    if add_input:
        residual = x
    for name, t in (("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2), ("residual", residual)):
        if t is not None:
            _checks.like(name, t, x, op)
    if not _kernels.use_kernels(op, x, _kernels.BF16_FP16, (x.shape[-1], w1.shape[0], w2.shape[0])):
        return mlp_reference(x, w1, b1, w2, b2, activation, residual)
    return torch.ops.coda.mlp.default(x, w1, b1, w2, b2, residual, act, False)[0]
