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


# ---- norms in front of GEMMs

def row_stats(x: torch.Tensor, layernorm: bool, eps: float):
    """(mean or None, rstd) per row in float32, as F.layer_norm / F.rms_norm compute them."""
    return row_stats_in(x, layernorm, eps, torch.float32)


def normalize(x, weight, bias, eps: float, layernorm: bool, mean=None, rstd=None):
    """LayerNorm / RMSNorm of x (..., D); with given per-row (mean, rstd) in float32
    (..., ), e.g. from linear_residual, those are used for the value while the
    gradient is that of the true norm (the stats are functions of x)."""
    d = x.shape[-1]
    if rstd is None:
        if layernorm:
            return F.layer_norm(x, (d,), weight, bias, eps)
        return F.rms_norm(x, (d,), weight, eps)
    xf = x.float()
    mean_given = mean.unsqueeze(-1) if layernorm else None
    rstd_given = rstd.unsqueeze(-1)
    with torch.no_grad():
        mean_x, rstd_x = row_stats(x, layernorm, eps)
    if layernorm:
        y = F.layer_norm(xf, (d,), None, None, eps)
        y = y + ((xf - mean_given) * rstd_given - (xf - mean_x.unsqueeze(-1)) * rstd_x.unsqueeze(-1)).detach()
    else:
        y = F.rms_norm(xf, (d,), None, eps)
        y = y + (xf * rstd_given - xf * rstd_x.unsqueeze(-1)).detach()
    y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def norm_linear_ref(x, norm_weight, norm_bias, weight, bias=None, layernorm: bool = True, eps: float = 1e-5,
                    activation: Optional[str] = None, mean=None, rstd=None):
    """act(Norm(x)·weightᵀ + bias), unfused."""
    return linear_ref(normalize(x, norm_weight, norm_bias, eps, layernorm, mean, rstd), weight, bias, activation)


def norm_mlp_ref(x, norm_weight, norm_bias, w1, b1, w2, b2, layernorm: bool = True, eps: float = 1e-5,
                 activation: Optional[str] = "gelu_tanh", residual=None, mean=None, rstd=None):
    """fc2(act(fc1(Norm(x)))) (+ residual), unfused."""
    return mlp_ref(normalize(x, norm_weight, norm_bias, eps, layernorm, mean, rstd), w1, b1, w2, b2, activation,
                   residual)


def fold_norm_weight(weight, gamma, beta, bias):
    """(W∘γ rounded, s = Σ_k W̃ in float32, t = W·β + b in float32): the folded weight."""
    folded = (weight.float() * gamma.float()).to(weight.dtype)
    s = folded.float().sum(-1)
    t = weight.float() @ beta.float() if beta is not None else weight.new_zeros(weight.shape[0], dtype=torch.float32)
    if bias is not None:
        t = t + bias.float()
    return folded, s, t


def norm_input_backward(dh, x, norm_weight, norm_bias, weight, layernorm: bool, eps: float,
                        need_dx: bool, need_dnorm: bool, need_dw: bool):
    """The backward of Norm(x)·Wᵀ given dh, its output's gradient, as the unfused
    torch path computes it: dW from the normalized input, dgrad in x's dtype,
    the norm's backward in float32 (at least). -> (dx, dγ, dβ or None, dW)."""
    ct = torch.promote_types(x.dtype, torch.float32)
    mean, rstd = (t.to(ct) if t is not None else None for t in row_stats_in(x, layernorm, eps, ct))
    xf = x.to(ct)
    xhat = (xf - mean[:, None]) * rstd[:, None] if layernorm else xf * rstd[:, None]
    normalized = xhat * norm_weight.to(ct)
    if norm_bias is not None:
        normalized = normalized + norm_bias.to(ct)
    dw = dh.t() @ normalized.to(x.dtype) if need_dw else dh.new_empty(0)
    g = (dh @ weight).to(ct)
    dnw = (g * xhat).sum(0).to(x.dtype) if need_dnorm else dh.new_empty(0)
    dnb = g.sum(0).to(x.dtype) if need_dnorm and norm_bias is not None else dh.new_empty(0)
    if need_dx:
        gg = g * norm_weight.to(ct)
        c1 = (gg * xhat).mean(-1, keepdim=True)
        inner = gg - xhat * c1
        if layernorm:
            inner = inner - gg.mean(-1, keepdim=True)
        dx = (rstd[:, None] * inner).to(x.dtype)
    else:
        dx = dh.new_empty(0)
    return dx, dnw, dnb, dw


def row_stats_in(x, layernorm: bool, eps: float, ct):
    xf = x.to(ct)
    if layernorm:
        var, mean = torch.var_mean(xf, -1, correction=0)
        return mean, torch.rsqrt(var + eps)
    return None, torch.rsqrt(xf.square().mean(-1) + eps)


def norm_linear_backward(dy, x, norm_weight, norm_bias, weight, has_bias: bool, pre, layernorm: bool, eps: float,
                         act: int, needs):
    """-> (dx, dγ, dβ, dW, db); pre is the pre-activation (the output with identity)."""
    need_dx, need_dnw, need_dnb, need_dw, need_db = needs
    dh = act_backward(dy, pre, act)
    dx, dnw, dnb, dw = norm_input_backward(dh, x, norm_weight, norm_bias, weight, layernorm, eps, need_dx,
                                           need_dnw or need_dnb, need_dw)
    db = bias_grad(dh) if has_bias and need_db else dy.new_empty(0)
    return dx, dnw, dnb, dw, db


def norm_mlp_backward(dy, x, norm_weight, norm_bias, w1, w2, h1, a1, has_b1: bool, has_b2: bool, add_input: bool,
                      layernorm: bool, eps: float, act: int, needs):
    """-> (dx, dγ, dβ, dW1, db1, dW2, db2)."""
    need_dx, need_dnw, need_dnb, need_dw1, need_db1, need_dw2, need_db2 = needs
    dw2 = dy.t() @ a1 if need_dw2 else dy.new_empty(0)
    db2 = bias_grad(dy) if has_b2 and need_db2 else dy.new_empty(0)
    dh1 = act_backward(dy @ w2, h1, act)
    db1 = bias_grad(dh1) if has_b1 and need_db1 else dy.new_empty(0)
    dx, dnw, dnb, dw1 = norm_input_backward(dh1, x, norm_weight, norm_bias, w1, layernorm, eps,
                                            need_dx or add_input, need_dnw or need_dnb, need_dw1)
    if add_input and need_dx:
        dx = dx + dy
    return dx, dnw, dnb, dw1, db1, dw2, db2
