"""Norms folded into the GEMM after them, and the GEMM before them that
writes their row statistics.

    Norm(x)·Wᵀ + b = rstd ⊙ (x·W̃ᵀ − mean ⊙ s) + t,  W̃ = W∘γ, s = Σ_k W̃, t = W·β + b

The GEMM reads x itself; its epilogue applies the per-row (mean, rstd) and
the per-column (s, t) (cutlass_epilogues/norm_linear_act.hpp). γ goes on the
weight, not on x: tests/test_norm_fold_numerics.py shows why. Backward: the
row dots c₁, c₂ come from the epilogue that produces dP (fc2's dgrad in the
MLP) or one pass over dP (a lone norm-linear), and the norm's input
gradient, dγ, dβ and the normalized input for dW from the dgrad GEMM's
epilogue (norm_dgrad.hpp). bf16 kernels; other dtypes and CPU tensors run
the reference path.

Row statistics travel between ops as float32 (..., 2): per row (mean, rstd)
for LayerNorm, (0, rstd) for RMSNorm, stored as the transpose of a (2, rows)
tensor so that the kernels read each column as a contiguous vector.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _activations, _kernels
from . import _checks
from ._common import autocast, rows
from .linear import linear_reference, mlp_reference

__all__ = ["layernorm_linear", "rmsnorm_linear", "norm_mlp", "linear_residual", "row_stats", "fold_norm_weight",
           "FoldedWeight", "rmsnorm_residual", "rmsnorm_residual_reference"]


class FoldedWeight(NamedTuple):
    """A norm-GEMM's weight folded once (fold_norm_weight), for forwards that
    reuse it: W̃ = W∘γ, s = Σ_k W̃ (None for RMSNorm), t = W·β + b."""
    weight: Tensor
    col_sum: Optional[Tensor]
    shift: Tensor


def _f32(like: Tensor, *shape: int) -> Tensor:
    return like.new_empty(shape if shape else (0,), dtype=torch.float32)


def _stats_fake(like: Tensor, m: int) -> Tensor:
    """(2, m) float32 whose rows start 16 bytes apart at least (a row stride of
    m rounded up to 4), as the C++ ops allocate them: rstd aligned for any m."""
    return _f32(like, 2, (m + 3) // 4 * 4)[:, :m]


if _kernels.available():

    @torch.library.register_fake("coda::row_stats")
    def _(x, layernorm, eps):
        return _stats_fake(x, math.prod(x.shape[:-1]))

    @torch.library.register_fake("coda::fold_norm_weight")
    def _(weight, gamma, beta, bias, layernorm):
        n = weight.shape[0]
        return weight.new_empty(weight.shape), _f32(weight, n if layernorm else 0), _f32(weight, n)

    def _state_fake(x, n, stats, folded, layernorm):
        m = math.prod(x.shape[:-1])
        return (_f32(x) if stats is not None else _stats_fake(x, m),
                _f32(x) if folded is not None or not layernorm else _f32(x, n),
                _f32(x) if folded is not None else _f32(x, n))

    @torch.library.register_fake("coda::norm_linear")
    def _(x, norm_weight, norm_bias, weight, bias, stats, folded, col_sum, shift, layernorm, eps, activation,
          save_pre_act):
        out = (*x.shape[:-1], weight.shape[0])
        save = save_pre_act and activation != _activations.IDENTITY
        return (x.new_empty(out), x.new_empty(out) if save else x.new_empty(0),
                *_state_fake(x, weight.shape[0], stats, folded, layernorm))

    @torch.library.register_fake("coda::norm_linear_backward")
    def _(dy, x, norm_weight, norm_bias, weight, pre_act, stats, col_sum, shift, layernorm, activation, needs):
        e = x.new_empty
        return (e(x.shape) if needs[0] else e(0), e(norm_weight.shape) if needs[1] else e(0),
                e(norm_weight.shape) if needs[2] else e(0), e(weight.shape) if needs[3] else e(0),
                e(weight.shape[0]) if needs[4] else e(0))

    @torch.library.register_fake("coda::norm_mlp")
    def _(x, norm_weight, norm_bias, w1, b1, w2, b2, stats, folded, col_sum, shift, residual, add_input, layernorm,
          eps, activation, save, want_stats):
        m, f = math.prod(x.shape[:-1]), w1.shape[0]
        save_h = save and activation != _activations.IDENTITY
        return (x.new_empty(*x.shape[:-1], w2.shape[0]), x.new_empty(m, f) if save_h else x.new_empty(0),
                x.new_empty(m, f) if save else x.new_empty(0), *_state_fake(x, f, stats, folded, layernorm),
                _stats_fake(x, m) if want_stats else _f32(x))

    @torch.library.register_fake("coda::norm_mlp_backward")
    def _(dy, x, norm_weight, norm_bias, w1, w2, h1, a1, stats, col_sum, shift, add_input, layernorm, activation,
          needs):
        e = x.new_empty
        return (e(x.shape) if needs[0] else e(0), e(norm_weight.shape) if needs[1] else e(0),
                e(norm_weight.shape) if needs[2] else e(0), e(w1.shape) if needs[3] else e(0),
                e(w1.shape[0]) if needs[4] else e(0), e(w2.shape) if needs[5] else e(0),
                e(w2.shape[0]) if needs[6] else e(0))

    @torch.library.register_fake("coda::linear_residual")
    def _(x, weight, bias, residual, layernorm, eps):
        return x.new_empty(*x.shape[:-1], weight.shape[0]), _stats_fake(x, math.prod(x.shape[:-1]))

    @torch.library.register_fake("coda::rmsnorm_residual")
    def _(x, weight, residual, eps, zero_centered):
        return x.new_empty(x.shape), _f32(x, math.prod(x.shape[:-1]))

    @torch.library.register_fake("coda::rmsnorm_residual_backward")
    def _(dy, x, weight, rstd, zero_centered, needs):
        return x.new_empty(x.shape) if needs[0] else x.new_empty(0), \
            weight.new_empty(weight.shape) if needs[1] else x.new_empty(0)


# ---- statistics: (2, rows) inside, (..., 2) outside

def _to_rows(stats: Optional[Tensor]) -> Optional[Tensor]:
    """(..., 2) -> the (2, rows) tensor the kernels read (a view of what
    linear_residual / row_stats returned; a copy of anything else)."""
    return None if stats is None else stats.detach().reshape(-1, 2).t()


def _to_user(stats: Tensor, lead) -> Tensor:
    return stats.t().reshape(*lead, 2)


def _row_stats_reference(y: Tensor, layernorm: bool, eps: float) -> Tensor:
    """(2, rows) float32, as F.layer_norm / F.rms_norm compute them."""
    yf = y.detach().float()
    if layernorm:
        var, mean = torch.var_mean(yf, -1, correction=0)
    else:
        var, mean = yf.square().mean(-1), torch.zeros_like(yf[:, 0])
    return torch.stack([mean, torch.rsqrt(var + eps)])


def normalize_reference(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float, layernorm: bool,
                        stats: Optional[Tensor] = None) -> Tensor:
    """LayerNorm / RMSNorm of x (..., D). With stats ((2, rows) float32, e.g.
    from linear_residual) those give the value, while the gradient is that of
    the true norm: the statistics are functions of x."""
    d = x.shape[-1]
    if stats is None:
        if layernorm:
            return F.layer_norm(x, (d,), weight, bias, eps)
        return F.rms_norm(x, (d,), weight, eps)
    xf = rows(x).float()
    mean_x, rstd_x = _row_stats_reference(xf, layernorm, eps)
    given_mean, given_rstd = stats[0].unsqueeze(-1), stats[1].unsqueeze(-1)
    if layernorm:
        y = F.layer_norm(xf, (d,), None, None, eps)
        y = y + ((xf - given_mean) * given_rstd - (xf - mean_x.unsqueeze(-1)) * rstd_x.unsqueeze(-1)).detach()
    else:
        y = F.rms_norm(xf, (d,), None, eps)
        y = y + (xf * given_rstd - xf * rstd_x.unsqueeze(-1)).detach()
    y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(x.shape)


def row_stats(y: Tensor, normalization: str = "LayerNorm", eps: Optional[float] = None) -> Tensor:
    """(..., F) -> float32 (..., 2): per row (mean, rstd) for LayerNorm, (0, rstd) for RMSNorm."""
    op = "row_stats"
    _checks.x_input(y, op, "y")
    layernorm = _checks.layernorm(normalization, op)
    eps = _checks.eps_of(eps, layernorm, y, op)
    y2 = rows(y.detach())
    if _kernels.use_kernels(op, y2, _kernels.BF16, (y2.shape[-1],)):
        st = torch.ops.coda.row_stats(y2, layernorm, eps)
    else:
        st = _row_stats_reference(y2, layernorm, eps)
    return _to_user(st, y.shape[:-1])


def fold_norm_weight(weight: Tensor, norm_weight: Tensor, norm_bias: Optional[Tensor] = None,
                     bias: Optional[Tensor] = None, normalization: str = "LayerNorm") -> FoldedWeight:
    """The folded weight of Norm -> Linear, for forwards that reuse it (pass
    it as `folded=`): one pass over the weight, which a forward otherwise
    makes every time. It is a copy: fold again after the weights change
    (coda.nn modules do, see LayerNormLinear.fold_weights). No gradient flows
    through it."""
    op = "fold_norm_weight"
    layernorm = _checks.layernorm(normalization, op)
    _checks.x_input(weight, op, "weight")
    _checks.vector("norm_weight", norm_weight, weight.shape[-1], op, " (in_features of weight)")
    _checks.vector("norm_bias", norm_bias, weight.shape[-1], op, " (in_features of weight)")
    _checks.vector("bias", bias, weight.shape[0], op, " (out_features of weight)")
    with torch.no_grad():
        if weight.dim() == 2 and _kernels.use_kernels(op, weight, _kernels.BF16, tuple(weight.shape)):
            w, s, t = torch.ops.coda.fold_norm_weight(weight, norm_weight, norm_bias, bias, layernorm)
            return FoldedWeight(w, s if layernorm else None, t)
        folded = (weight.float() * norm_weight.float()).to(weight.dtype)
        t = weight.float() @ norm_bias.float() if norm_bias is not None else weight.new_zeros(weight.shape[0]).float()
        if bias is not None:
            t = t + bias.float()
        return FoldedWeight(folded, folded.float().sum(-1) if layernorm else None, t)


def _check_norm(op: str, x: Tensor, norm_weight: Tensor, norm_bias: Optional[Tensor], layernorm: bool,
                stats: Optional[Tensor], folded: Optional[FoldedWeight], weight: Tensor) -> None:
    d = x.shape[-1]
    if norm_weight is None:
        raise ValueError(f"coda.{op}: norm_weight is required")
    _checks.vector("norm_weight", norm_weight, d, op, f" (the last dimension of x, {tuple(x.shape)})")
    if norm_bias is not None and not layernorm:
        raise ValueError(f"coda.{op}: norm_bias must be None for RMSNorm")
    _checks.vector("norm_bias", norm_bias, d, op, f" (the last dimension of x, {tuple(x.shape)})")
    _checks.stats(stats, x, op)
    if folded is not None:
        if not isinstance(folded, FoldedWeight) or tuple(folded.weight.shape) != tuple(weight.shape):
            raise ValueError(f"coda.{op}: folded must be the FoldedWeight of this weight "
                             f"(coda.ops.fold_norm_weight), got {type(folded).__name__}")
        if (folded.col_sum is not None) != layernorm:
            raise ValueError(f"coda.{op}: folded was made for the other normalization")


def _fold_args(folded: Optional[FoldedWeight]):
    return (None, None, None) if folded is None else tuple(folded)


# ---- norm -> Linear: act(Norm(x)·Wᵀ + b)

def norm_linear_reference(x, norm_weight, norm_bias, weight, bias=None, normalization: str = "LayerNorm",
                          eps: Optional[float] = None, activation: Optional[str] = None,
                          stats: Optional[Tensor] = None) -> Tensor:
    """act(Norm(x)·weightᵀ + bias), unfused; stats as the fused ops take them."""
    layernorm = _checks.layernorm(normalization, "norm_linear")
    eps = _checks.eps_of(eps, layernorm, x, "norm_linear")
    n = normalize_reference(x, norm_weight, norm_bias, eps, layernorm, _to_rows(stats))
    return linear_reference(n, weight, bias, activation)


def _norm_linear(op, x, norm_weight, norm_bias, weight, bias, eps, activation, stats, folded, layernorm):
    _checks.x_input(x, op)
    _checks.weight("weight", weight, x.shape[-1], op, "x", x.shape)
    _check_norm(op, x, norm_weight, norm_bias, layernorm, stats, folded, weight)
    _checks.vector("bias", bias, weight.shape[0], op, " (out_features of weight)")
    act = _activations.code(activation)
    eps = _checks.eps_of(eps, layernorm, x, op)
    x, norm_weight, norm_bias, weight, bias = autocast(x, norm_weight, norm_bias, weight, bias)
    for name, t in (("norm_weight", norm_weight), ("norm_bias", norm_bias), ("weight", weight), ("bias", bias)):
        if t is not None:
            _checks.like(name, t, x, op)
    if not _kernels.use_kernels(op, x, _kernels.BF16, (x.shape[-1], weight.shape[0])):
        n = normalize_reference(x, norm_weight, norm_bias, eps, layernorm, _to_rows(stats))
        return linear_reference(n, weight, bias, activation)
    return torch.ops.coda.norm_linear.default(x, norm_weight, norm_bias, weight, bias, _to_rows(stats),
                                              *_fold_args(folded), layernorm, eps, act, False)[0]


def layernorm_linear(x: Tensor, ln_weight: Tensor, ln_bias: Optional[Tensor], weight: Tensor,
                     bias: Optional[Tensor] = None, eps: float = 1e-5, activation: Optional[str] = None,
                     stats: Optional[Tensor] = None, folded: Optional[FoldedWeight] = None) -> Tensor:
    """act(LayerNorm(x)·weightᵀ + bias) in one GEMM: the norm is folded into it.

    x: (..., D); ln_weight, ln_bias: (D,); weight: (N, D); bias: (N,) or None;
    stats: optional float32 (..., 2) per-row (mean, rstd) of x, e.g. from
    linear_residual (without it one light pass over x computes them);
    folded: optional fold_norm_weight(weight, ln_weight, ln_bias, bias) to
    reuse. Returns (..., N).
    """
    return _norm_linear("layernorm_linear", x, ln_weight, ln_bias, weight, bias, eps, activation, stats, folded, True)


def rmsnorm_linear(x: Tensor, norm_weight: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                   eps: Optional[float] = None, activation: Optional[str] = None, stats: Optional[Tensor] = None,
                   folded: Optional[FoldedWeight] = None) -> Tensor:
    """act(RMSNorm(x)·weightᵀ + bias) in one GEMM. eps None is the dtype's
    machine epsilon, as nn.RMSNorm has it; stats: optional float32 (..., 2),
    (0, rstd) per row."""
    return _norm_linear("rmsnorm_linear", x, norm_weight, None, weight, bias, eps, activation, stats, folded, False)


# ---- norm -> MLP: fc2(act(fc1(Norm(x)))) + residual

def norm_mlp_reference(x, norm_weight, norm_bias, w1, b1, w2, b2, normalization: str = "LayerNorm",
                       eps: Optional[float] = None, activation: Optional[str] = "gelu_tanh", residual=None,
                       stats: Optional[Tensor] = None,
                       return_stats: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """fc2(act(fc1(Norm(x)))) (+ residual), unfused; stats and return_stats as norm_mlp takes them."""
    layernorm = _checks.layernorm(normalization, "norm_mlp")
    eps = _checks.eps_of(eps, layernorm, x, "norm_mlp")
    n = normalize_reference(x, norm_weight, norm_bias, eps, layernorm, _to_rows(stats))
    y = mlp_reference(n, w1, b1, w2, b2, activation, residual)
    if not return_stats:
        return y
    return y, _to_user(_row_stats_reference(rows(y), layernorm, eps), y.shape[:-1])


def norm_mlp(x: Tensor, norm_weight: Tensor, norm_bias: Optional[Tensor], w1: Tensor, b1: Optional[Tensor],
             w2: Tensor, b2: Optional[Tensor], normalization: str = "LayerNorm", eps: Optional[float] = None,
             activation: Optional[str] = "gelu_tanh", residual: Optional[Tensor] = None,
             stats: Optional[Tensor] = None, folded: Optional[FoldedWeight] = None,
             return_stats: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """fc2(act(fc1(Norm(x)))) + residual: the norm folded into fc1, everything else in epilogues.

    x: (..., D); norm_weight, norm_bias: (D,) (norm_bias None for RMSNorm);
    w1: (F, D); b1: (F,) or None; w2: (D', F); b2: (D',) or None; residual:
    (..., D') or None — passing x itself (the pre-norm block x + MLP(Norm(x)))
    also folds the residual's gradient into fc1's dgrad epilogue; eps: None
    for the norm's default (1e-5 LayerNorm, machine epsilon RMSNorm); stats:
    optional float32 (..., 2) per-row (mean, rstd) of x; folded: optional
    fold_norm_weight(w1, norm_weight, norm_bias, b1) to reuse. With
    return_stats, returns (y, stats of y (..., 2)): the row statistics of the
    same norm and eps (reduced in fc2's epilogue), for the next block's norm;
    else y.
    """
    op = "norm_mlp"
    layernorm = _checks.layernorm(normalization, op)
    _checks.x_input(x, op)
    _checks.weight("w1", w1, x.shape[-1], op, "x", x.shape)
    _check_norm(op, x, norm_weight, norm_bias, layernorm, stats, folded, w1)
    _checks.vector("b1", b1, w1.shape[0], op, " (out_features of w1)")
    _checks.weight("w2", w2, w1.shape[0], op, "fc1's output (w1)", (*x.shape[:-1], w1.shape[0]))
    _checks.vector("b2", b2, w2.shape[0], op, " (out_features of w2)")
    out_shape = (*x.shape[:-1], w2.shape[0])
    if residual is not None:
        _checks.matrix_like("residual", residual, out_shape, op)
    add_input = residual is x
    act = _activations.code(activation)
    eps = _checks.eps_of(eps, layernorm, x, op)
    x, norm_weight, norm_bias, w1, b1, w2, b2, residual = autocast(x, norm_weight, norm_bias, w1, b1, w2, b2,
                                                                   residual)
    if add_input:
        residual = x
    for name, t in (("norm_weight", norm_weight), ("norm_bias", norm_bias), ("w1", w1), ("b1", b1), ("w2", w2),
                    ("b2", b2), ("residual", residual)):
        if t is not None:
            _checks.like(name, t, x, op)
    if not _kernels.use_kernels(op, x, _kernels.BF16, (x.shape[-1], w1.shape[0], w2.shape[0])):
        return norm_mlp_reference(x, norm_weight, norm_bias, w1, b1, w2, b2, normalization, eps, activation, residual,
                                  stats, return_stats)
    out = torch.ops.coda.norm_mlp.default(x, norm_weight, norm_bias, w1, b1, w2, b2, _to_rows(stats),
                                          *_fold_args(folded), None if add_input else residual, add_input,
                                          layernorm, eps, act, False, bool(return_stats))
    return (out[0], _to_user(out[6], out[0].shape[:-1])) if return_stats else out[0]


# ---- residual-reduce: Y = x·Wᵀ + b + R and the next norm's row statistics

def linear_residual(x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Tensor,
                    normalization: str = "LayerNorm", eps: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """Y = x·weightᵀ + bias + residual, and the row statistics the next norm needs, in one GEMM.

    Returns (Y (..., N), stats float32 (..., 2)): per row (mean, rstd) for
    LayerNorm, (0, rstd) for RMSNorm, reduced in the GEMM's epilogue, for
    layernorm_linear / rmsnorm_linear / norm_mlp. eps: the next norm's (None:
    its default). The statistics carry no gradient: those ops' backward treats
    them as functions of Y.
    """
    op = "linear_residual"
    _checks.x_input(x, op)
    _checks.weight("weight", weight, x.shape[-1], op, "x", x.shape)
    _checks.vector("bias", bias, weight.shape[0], op, " (out_features of weight)")
    out_shape = (*x.shape[:-1], weight.shape[0])
    _checks.matrix_like("residual", residual, out_shape, op)
    layernorm = _checks.layernorm(normalization, op)
    eps = _checks.eps_of(eps, layernorm, x, op)
    add_input = residual is x  # still x itself after autocast, as in mlp
    x, weight, bias, residual = autocast(x, weight, bias, residual)
    if add_input:
        residual = x
    for name, t in (("weight", weight), ("bias", bias), ("residual", residual)):
        if t is not None:
            _checks.like(name, t, x, op)
    if not _kernels.use_kernels(op, x, _kernels.BF16, (x.shape[-1], weight.shape[0])):
        y = F.linear(x, weight, bias) + residual
        return y, _to_user(_row_stats_reference(rows(y), layernorm, eps), out_shape[:-1])
    y, st = torch.ops.coda.linear_residual.default(x, weight, bias, residual, layernorm, eps)
    return y, _to_user(st, out_shape[:-1])


# ---- Gemma's sandwich norms: residual + RMSNorm(x), the norm on a GEMM's output before the residual add

def rmsnorm_residual_reference(x: Tensor, weight: Tensor, residual: Tensor, eps: float,
                               zero_centered: bool = False) -> Tensor:
    """residual + RMSNorm(x)·γ unfused, as Hugging Face's Gemma RMSNorm computes it: in float32, γ = 1 + weight
    where zero_centered (else weight), the norm rounded to x's dtype, then the residual added."""
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32  # a float64 reference stays float64
    xf, wf = x.to(wide), weight.to(wide)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return residual + (normed * ((1.0 + wf) if zero_centered else wf)).type_as(x)


def rmsnorm_residual(x: Tensor, weight: Tensor, residual: Tensor, eps: float, zero_centered: bool = False) -> Tensor:
    """residual + RMSNorm(x)·γ in one pass over the rows, forward and backward: Gemma's sandwich norms
    (post_attention_layernorm, post_feedforward_layernorm) between a GEMM's output x and the residual add.

    x, residual: (..., D); weight: (D,), γ = 1 + weight where zero_centered (Gemma's), in float32; eps:
    the norm's. Kernels: bf16 / fp16 CUDA tensors, D a multiple of 8; anything else runs
    rmsnorm_residual_reference. Returns (..., D).
    """
    op = "rmsnorm_residual"
    _checks.x_input(x, op)
    _checks.vector("weight", weight, x.shape[-1], op, " (features of x)")
    if weight is None:
        raise ValueError(f"coda.{op}: weight must be given")
    _checks.matrix_like("residual", residual, tuple(x.shape), op)
    for name, t in (("weight", weight), ("residual", residual)):
        if t.device != x.device:
            raise ValueError(f"coda.{op}: {name} is on {t.device}, expected {x.device} (the device of x)")
    if residual.dtype != x.dtype or not _kernels.use_kernels(op, x, _kernels.BF16_FP16, (x.shape[-1],)):
        return rmsnorm_residual_reference(x, weight, residual, eps, zero_centered)
    return torch.ops.coda.rmsnorm_residual.default(x, weight, residual, float(eps), bool(zero_centered))[0]
