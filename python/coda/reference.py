"""Plain-torch references for every fused op.

These are the reference path (CPU tensors, shapes or dtypes without a
kernel) and the baselines the tests and benchmarks compare against. Run them
on float64 inputs for a ground truth.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import _activations


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
               activation: Optional[str] = None) -> torch.Tensor:
    """act(x·weightᵀ + bias), unfused."""
    return _activations.apply(F.linear(x, weight, bias), _activations.code(activation))


def mlp_ref(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor], w2: torch.Tensor,
            b2: Optional[torch.Tensor], activation: Optional[str] = "gelu_tanh",
            residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fc2(act(fc1(x))) (+ residual), unfused."""
    y = F.linear(linear_ref(x, w1, b1, activation), w2, b2)
    return y if residual is None else y + residual


# ---- the pieces of the reference path, in the ops' own terms (2-D tensors)

def linear_forward(x, weight, bias, act: int, save_pre_act: bool):
    h = F.linear(x, weight, bias)
    if act == _activations.IDENTITY:
        return h, x.new_empty(0)
    y = _activations.apply(h, act)
    return y, (h if save_pre_act else x.new_empty(0))


def act_backward(dy, h, act: int):
    """dy ⊙ act'(h), computed in float32 (at least) and rounded once, as torch does."""
    if act == _activations.IDENTITY:
        return dy
    ct = torch.promote_types(dy.dtype, torch.float32)
    return (dy.to(ct) * _activations.grad(h.to(ct), act)).to(dy.dtype)


def bias_grad(dh):
    ct = torch.promote_types(dh.dtype, torch.float32)
    return dh.sum(0, dtype=ct).to(dh.dtype)


def linear_backward(dy, x, weight, h, act: int, has_bias: bool, need_dx: bool, need_dw: bool):
    dh = act_backward(dy, h, act)
    dx = dh @ weight if need_dx else dy.new_empty(0)
    dw = dh.t() @ x if need_dw else dy.new_empty(0)
    db = bias_grad(dh) if has_bias else dy.new_empty(0)
    return dx, dw, db


def mlp_forward(x, w1, b1, w2, b2, residual, act: int, save: bool):
    h1 = F.linear(x, w1, b1)
    a1 = _activations.apply(h1, act)
    y = F.linear(a1, w2, b2)
    if residual is not None:
        y = y + residual
    if not save:
        return y, x.new_empty(0), x.new_empty(0)
    if act == _activations.IDENTITY:  # h1 is a1: keep one, outputs may not alias
        return y, x.new_empty(0), a1
    return y, h1, a1


def mlp_backward(dy, x, w1, w2, h1, a1, act: int, has_b1: bool, has_b2: bool,
                 need_dx: bool, need_dw1: bool, need_dw2: bool):
    dw2 = dy.t() @ a1 if need_dw2 else dy.new_empty(0)
    db2 = bias_grad(dy) if has_b2 else dy.new_empty(0)
    dh1 = act_backward(dy @ w2, h1, act)
    dw1 = dh1.t() @ x if need_dw1 else dy.new_empty(0)
    db1 = bias_grad(dh1) if has_b1 else dy.new_empty(0)
    dx = dh1 @ w1 if need_dx else dy.new_empty(0)
    return dx, dw1, db1, dw2, db2
