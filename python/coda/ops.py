"""coda's fused ops: one torch.library op per fused op, forward and backward.

Each public function takes PyTorch's layouts (activations (..., features),
nn.Linear weights (out, in)) and runs one custom op, so torch.compile traces
it whole (fullgraph=True). Kernel-ready CUDA inputs run CUTLASS kernels whose
epilogues do the elementwise work; everything else runs the reference path
in coda.reference, which gives the same answer.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _activations, _fold_cache, _kernels, reference

__all__ = ["linear", "mlp", "layernorm_linear", "rmsnorm_linear", "norm_mlp", "linear_residual", "row_stats"]


# ---- argument checks: errors name the argument and what was expected

def _check_same(name: str, t: Tensor, x: Tensor, op: str) -> None:
    if t.dtype != x.dtype:
        raise TypeError(f"coda.{op}: {name} has dtype {t.dtype}, expected {x.dtype} (the dtype of x)")
    if t.device != x.device:
        raise ValueError(f"coda.{op}: {name} is on {t.device}, expected {x.device} (the device of x)")


def _check_weight(name: str, w: Tensor, in_features: int, x: Tensor, op: str) -> None:
    if not isinstance(w, Tensor):
        raise TypeError(f"coda.{op}: {name} must be a Tensor, got {type(w).__name__}")
    if w.dim() != 2 or w.shape[1] != in_features:
        raise ValueError(f"coda.{op}: {name} must have shape (out_features, {in_features}), got {tuple(w.shape)}")
    _check_same(name, w, x, op)


def _check_bias(name: str, b: Optional[Tensor], n: int, x: Tensor, op: str) -> None:
    if b is None:
        return
    if b.dim() != 1 or b.shape[0] != n:
        raise ValueError(f"coda.{op}: {name} must have shape ({n},), got {tuple(b.shape)}")
    _check_same(name, b, x, op)


def _check_x(x: Tensor, op: str) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"coda.{op}: x must be a Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(f"coda.{op}: x must have at least one dimension (..., in_features), got a scalar")
    if not x.is_floating_point():
        raise TypeError(f"coda.{op}: x must be a floating-point tensor, got {x.dtype}")


def _rows(t: Tensor) -> Tensor:
    """(..., F) -> (rows, F); explicit, so F = 0 is not ambiguous."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _state_outputs(ctx, outputs) -> None:
    """An op's outputs after the first are state for its backward (pre-activations,
    statistics, a fold), not values to differentiate. Left differentiable, autograd
    hands the backward a zero tensor the size of each, which it never reads: two
    512 MB fills per MLP backward at 16,384 tokens (2bcc65e run's kernel list).
    The backward then gets None for them, and for dy where no gradient reached y."""
    ctx.mark_non_differentiable(*outputs)
    ctx.set_materialize_grads(False)


def _needs_grad(*tensors: Optional[Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _contig(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.contiguous()


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0)


# ---- linear: y = act(x·Wᵀ + b)

@torch.library.custom_op("coda::linear", mutates_args=())
def _linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: int,
            save_pre_act: bool) -> Tuple[Tensor, Tensor]:
    # x (M, K), weight (N, K), bias (N) -> y (M, N), pre_act (M, N) or (0,)
    save = save_pre_act and activation != _activations.IDENTITY
    if x.shape[0] and _kernels.usable([x, weight, bias], [x.shape[1], weight.shape[0]]):
        return torch.ops.coda.gemm_linear(_kernels.rows(x), weight.contiguous(), _contig(bias), None,
                                          activation, save)
    return reference.linear_forward(x, weight, bias, activation, save)


@_linear.register_fake
def _(x, weight, bias, activation, save_pre_act):
    save = save_pre_act and activation != _activations.IDENTITY
    shape = (x.shape[0], weight.shape[0])
    return x.new_empty(shape), (x.new_empty(shape) if save else x.new_empty(0))


@torch.library.custom_op("coda::linear_backward", mutates_args=())
def _linear_backward(dy: Tensor, x: Tensor, weight: Tensor, pre_act: Tensor, activation: int, has_bias: bool,
                     need_dx: bool, need_dw: bool) -> Tuple[Tensor, Tensor, Tensor]:
    # dy (M, N), x (M, K), weight (N, K), pre_act (M, N) -> dx (M, K), dw (N, K), dbias (N); (0,) when not needed
    if x.shape[0] and _kernels.usable([dy, x, weight, pre_act], [x.shape[1], weight.shape[0]]):
        dy = _kernels.rows(dy)
        # A lone Linear gets dy from outside: act' needs its own pass here.
        # coda.ops.mlp folds it into the next GEMM's epilogue instead.
        dh = reference.act_backward(dy, pre_act, activation)
        dx = torch.ops.coda.gemm_dgrad(dh, weight.contiguous(), None, 0, False)[0] if need_dx else _empty(dy)
        dw = torch.ops.coda.gemm_wgrad(dh, _kernels.rows(x)) if need_dw else _empty(dy)
        db = reference.bias_grad(dh) if has_bias else _empty(dy)
        return dx, dw, db
    return reference.linear_backward(dy, x, weight, pre_act, activation, has_bias, need_dx, need_dw)


@_linear_backward.register_fake
def _(dy, x, weight, pre_act, activation, has_bias, need_dx, need_dw):
    return (x.new_empty(x.shape) if need_dx else x.new_empty(0),
            weight.new_empty(weight.shape) if need_dw else x.new_empty(0),
            x.new_empty(weight.shape[0]) if has_bias else x.new_empty(0))


def _linear_setup(ctx, inputs, output):
    x, weight, bias, activation, _ = inputs
    ctx.save_for_backward(x, weight, output[1])
    _state_outputs(ctx, output[1:])
    ctx.activation = activation
    ctx.has_bias = bias is not None


def _linear_grad(ctx, dy, _dpre_act):
    if dy is None:  # an undefined gradient in (_state_outputs), none out
        return (None,) * 5
    x, weight, pre_act = ctx.saved_tensors
    if ctx.activation != _activations.IDENTITY and pre_act.numel() != x.shape[0] * weight.shape[0]:
        raise RuntimeError("coda.linear: backward needs the pre-activation, which was not saved "
                           "(no input required grad when the forward ran)")
    need = ctx.needs_input_grad
    dx, dw, db = _linear_backward(dy, x, weight, pre_act, ctx.activation, ctx.has_bias and need[2],
                                  need[0], need[1])
    return (dx if need[0] else None, dw if need[1] else None, db if ctx.has_bias and need[2] else None,
            None, None)


_linear.register_autograd(_linear_grad, setup_context=_linear_setup)


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: Optional[str] = None) -> Tensor:
    """act(x·weightᵀ + bias) in one GEMM, its bias and activation in the epilogue.

    x: (..., in_features); weight: (out_features, in_features), nn.Linear's layout;
    bias: (out_features,) or None; activation: None, "gelu_tanh", "gelu" (erf),
    "relu" or "silu". Returns (..., out_features).
    """
    _check_x(x, "linear")
    _check_weight("weight", weight, x.shape[-1], x, "linear")
    _check_bias("bias", bias, weight.shape[0], x, "linear")
    act = _activations.code(activation)
    y, _ = _linear(_rows(x), weight, bias, act, _needs_grad(x, weight, bias))
    return y.reshape(*x.shape[:-1], weight.shape[0])


# ---- mlp: y = fc2(act(fc1(x))) + residual

@torch.library.custom_op("coda::mlp", mutates_args=())
def _mlp(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor],
         residual: Optional[Tensor], activation: int, save_for_backward: bool) -> Tuple[Tensor, Tensor, Tensor]:
    # x (M, D), w1 (F, D), b1 (F), w2 (E, F), b2 (E), residual (M, E)
    #   -> y (M, E), h1 (M, F) pre-activation, a1 (M, F) activation; (0,) when not saved
    if x.shape[0] and _kernels.usable([x, w1, b1, w2, b2, residual], [x.shape[1], w1.shape[0], w2.shape[0]]):
        save_h = save_for_backward and activation != _activations.IDENTITY
        a1, h1 = torch.ops.coda.gemm_linear(_kernels.rows(x), w1.contiguous(), _contig(b1), None, activation, save_h)
        y, _ = torch.ops.coda.gemm_linear(a1, w2.contiguous(), _contig(b2),
                                          None if residual is None else _kernels.rows(residual), 0, False)
        return y, h1, (a1 if save_for_backward else _empty(x))
    return reference.mlp_forward(x, w1, b1, w2, b2, residual, activation, save_for_backward)


@_mlp.register_fake
def _(x, w1, b1, w2, b2, residual, activation, save_for_backward):
    m, f = x.shape[0], w1.shape[0]
    save_h = save_for_backward and activation != _activations.IDENTITY
    return (x.new_empty(m, w2.shape[0]), x.new_empty(m, f) if save_h else x.new_empty(0),
            x.new_empty(m, f) if save_for_backward else x.new_empty(0))


@torch.library.custom_op("coda::mlp_backward", mutates_args=())
def _mlp_backward(dy: Tensor, x: Tensor, w1: Tensor, w2: Tensor, h1: Tensor, a1: Tensor, activation: int,
                  has_b1: bool, has_b2: bool, need_dx: bool, need_dw1: bool,
                  need_dw2: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    # -> dx (M, D), dw1 (F, D), db1 (F), dw2 (E, F), db2 (E); (0,) when not needed
    if x.shape[0] and _kernels.usable([dy, x, w1, w2, h1, a1], [x.shape[1], w1.shape[0], w2.shape[0]]):
        dy = _kernels.rows(dy)
        dw2 = torch.ops.coda.gemm_wgrad(dy, a1) if need_dw2 else _empty(dy)
        db2 = reference.bias_grad(dy) if has_b2 else _empty(dy)
        # fc2's dgrad epilogue applies act' (with the saved h1) and reduces db1:
        # no elementwise pass over the (M, F) activation gradient.
        fused_h = h1 if activation != _activations.IDENTITY else None
        dh1, db1 = torch.ops.coda.gemm_dgrad(dy, w2.contiguous(), fused_h, activation, has_b1)
        dw1 = torch.ops.coda.gemm_wgrad(dh1, x) if need_dw1 else _empty(dy)
        dx = torch.ops.coda.gemm_dgrad(dh1, w1.contiguous(), None, 0, False)[0] if need_dx else _empty(dy)
        return dx, dw1, db1, dw2, db2
    return reference.mlp_backward(dy, x, w1, w2, h1, a1, activation, has_b1, has_b2, need_dx, need_dw1, need_dw2)


@_mlp_backward.register_fake
def _(dy, x, w1, w2, h1, a1, activation, has_b1, has_b2, need_dx, need_dw1, need_dw2):
    e = x.new_empty
    return (e(x.shape) if need_dx else e(0), e(w1.shape) if need_dw1 else e(0), e(w1.shape[0]) if has_b1 else e(0),
            e(w2.shape) if need_dw2 else e(0), e(w2.shape[0]) if has_b2 else e(0))


def _mlp_setup(ctx, inputs, output):
    x, w1, b1, w2, b2, residual, activation, _ = inputs
    _, h1, a1 = output
    ctx.save_for_backward(x, w1, w2, h1, a1)
    _state_outputs(ctx, output[1:])
    ctx.activation = activation
    ctx.has_b1, ctx.has_b2, ctx.has_residual = b1 is not None, b2 is not None, residual is not None


def _mlp_grad(ctx, dy, _dh1, _da1):
    if dy is None:
        return (None,) * 8
    x, w1, w2, h1, a1 = ctx.saved_tensors
    if a1.numel() != x.shape[0] * w1.shape[0]:
        raise RuntimeError("coda.mlp: backward needs the saved activations, which were not kept "
                           "(no input required grad when the forward ran)")
    if ctx.activation == _activations.IDENTITY:
        h1 = a1
    nx, nw1, nb1, nw2, nb2, nres = ctx.needs_input_grad[:6]
    dx, dw1, db1, dw2, db2 = _mlp_backward(dy, x, w1, w2, h1, a1, ctx.activation, ctx.has_b1 and nb1,
                                           ctx.has_b2 and nb2, nx, nw1, nw2)
    return (dx if nx else None, dw1 if nw1 else None, db1 if ctx.has_b1 and nb1 else None,
            dw2 if nw2 else None, db2 if ctx.has_b2 and nb2 else None,
            dy if ctx.has_residual and nres else None, None, None)


_mlp.register_autograd(_mlp_grad, setup_context=_mlp_setup)


def mlp(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor],
        activation: Optional[str] = "gelu_tanh", residual: Optional[Tensor] = None) -> Tensor:
    """fc2(act(fc1(x))) + residual: two GEMMs, everything else in their epilogues.

    x: (..., D); w1: (F, D); b1: (F,) or None; w2: (E, F); b2: (E,) or None;
    residual: (..., E) or None. Returns (..., E). Forward: fc1's epilogue adds
    b1, applies act and keeps the pre-activation; fc2's adds b2 and the
    residual. Backward: fc2's dgrad epilogue applies act' and reduces db1.
    """
    _check_x(x, "mlp")
    _check_weight("w1", w1, x.shape[-1], x, "mlp")
    _check_bias("b1", b1, w1.shape[0], x, "mlp")
    _check_weight("w2", w2, w1.shape[0], x, "mlp")
    _check_bias("b2", b2, w2.shape[0], x, "mlp")
    out_shape = (*x.shape[:-1], w2.shape[0])
    if residual is not None:
        if tuple(residual.shape) != out_shape:
            raise ValueError(f"coda.mlp: residual must have shape {out_shape}, got {tuple(residual.shape)}")
        _check_same("residual", residual, x, "mlp")
        residual = _rows(residual)
    act = _activations.code(activation)
    y, _, _ = _mlp(_rows(x), w1, b1, w2, b2, residual, act,
                   _needs_grad(x, w1, b1, w2, b2, residual))
    return y.reshape(out_shape)


# ---- norms folded into GEMMs
#
#   Norm(x)·Wᵀ + b = rstd ⊙ (x·W̃ᵀ − mean ⊙ s) + t,  W̃ = W∘γ, s = Σ_k W̃, t = W·β + b
#
# The GEMM reads x itself; its epilogue applies the per-row (mean, rstd) and
# the per-column (s, t) (cutlass_epilogues/norm_linear_act.hpp). γ goes on the
# weight, not on x: tests/test_norm_fold_numerics.py shows why. The backward's
# row dots c₁, c₂ come from the epilogue that produces dP (fc2's dgrad in the
# MLP) or one pass over dP (a lone norm-linear), and the norm's input gradient,
# dγ, dβ and the normalized input for dW come from the dgrad GEMM's epilogue
# (norm_dgrad.hpp). bf16 kernels; other dtypes and CPU tensors run the
# unfused reference path.

NORMALIZATIONS = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}


def _norm_kind(normalization: str, op: str) -> str:
    key = normalization.lower() if isinstance(normalization, str) else normalization
    if key not in NORMALIZATIONS:
        raise ValueError(f"coda.{op}: normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")
    return key


def _check_norm_params(name: str, t: Optional[Tensor], d: int, x: Tensor, op: str, required: bool) -> None:
    if t is None:
        if required:
            raise ValueError(f"coda.{op}: {name} is required")
        return
    if t.dim() != 1 or t.shape[0] != d:
        raise ValueError(f"coda.{op}: {name} must have shape ({d},), got {tuple(t.shape)}")
    _check_same(name, t, x, op)


def _check_stats(stats: Optional[Tensor], x: Tensor, op: str) -> None:
    if stats is None:
        return
    want = (*x.shape[:-1], 2)
    if not isinstance(stats, Tensor) or tuple(stats.shape) != want or stats.dtype != torch.float32:
        got = f"{stats.dtype} {tuple(stats.shape)}" if isinstance(stats, Tensor) else type(stats).__name__
        raise ValueError(f"coda.{op}: stats must be a float32 tensor of shape {want} (mean, rstd per row), got {got}")
    if stats.device != x.device:
        raise ValueError(f"coda.{op}: stats is on {stats.device}, expected {x.device} (the device of x)")


def _split_stats(stats: Optional[Tensor], layernorm: bool):
    """(..., 2) stats -> contiguous per-row (mean or None, rstd) over the flattened rows."""
    if stats is None:
        return None, None
    stats = stats.detach().reshape(-1, 2)
    return (stats[:, 0].contiguous() if layernorm else None), stats[:, 1].contiguous()


def _empty_f32(like: Tensor, n: int = 0) -> Tensor:
    return like.new_empty(n, dtype=torch.float32)


def _stats_for(x: Tensor, mean: Optional[Tensor], rstd: Optional[Tensor], layernorm: bool, eps: float, fused: bool):
    """The row stats the fold uses: given ones, else one pass over x."""
    if rstd is not None:
        return (mean if layernorm else _empty_f32(x)), rstd
    if fused:
        return torch.ops.coda.norm_row_stats(x, layernorm, eps)
    m, r = reference.row_stats(x, layernorm, eps)
    return (m if layernorm else _empty_f32(x)), r


def _forward_rstd(rstd: Tensor, eps: float, layernorm: bool) -> Tensor:
    """The per-row factor the folded forward applies: rstd, but 0 for rows whose
    variance is below 2⁻¹⁹·eps (constant rows). Their x̂ = (x − mean)·rstd is 0
    (to |x̂| < 0.1 in the worst case), while the fold's rstd·(x·W̃ᵀ − mean·s)
    would multiply the fp32 rounding of two large sums by up to 1/sqrt(eps).
    RMSNorm subtracts nothing and needs no guard."""
    if not layernorm:
        return rstd
    return rstd.masked_fill(rstd >= (1.0 - 2.0**-20) / math.sqrt(eps), 0.0)


def _fold(w: Tensor, gamma: Tensor, beta: Optional[Tensor], bias: Optional[Tensor], layernorm: bool, fused: bool,
          cached: Optional[List[Tensor]] = None):
    """(W̃, s or empty for RMSNorm, t); `cached` is a (W̃, s, t) kept by _fold_cache."""
    if cached and fused:
        folded, s, t = cached
    elif fused:
        folded, s, t = torch.ops.coda.norm_fold_weight(w.contiguous(), gamma.contiguous(), _contig(beta),
                                                       _contig(bias), True)
    else:
        folded, s, t = reference.fold_norm_weight(w, gamma, beta, bias)
    return folded, (s if layernorm else _empty_f32(w)), t


def _not_given(stats: Tuple[Tensor, Tensor], fold: Tuple[Tensor, Tensor], given_stats: bool, given_fold: bool):
    """The (mean, rstd, s, t) a norm op returns for autograd: empty where the
    op's inputs already hold them (stats passed in, a fold from _fold_cache),
    since a custom op's outputs may not alias its inputs and copying them
    costs a launch each (_saved_norm_state takes them from the inputs)."""
    def empty():  # each its own: outputs may not alias one another either
        return stats[1].new_empty(0)
    return (*((empty(), empty()) if given_stats else stats), *((empty(), empty()) if given_fold else fold))


def _saved_norm_state(mean_in: Optional[Tensor], rstd_in: Optional[Tensor], folded_in: List[Tensor],
                      outputs: Tuple[Tensor, Tensor, Tensor, Tensor]):
    """(mean, rstd, s, t) for backward: the op's outputs, or the inputs _not_given left out."""
    mean, rstd, s, t = outputs
    if rstd_in is not None:
        mean, rstd = (mean if mean_in is None else mean_in), rstd_in
    if folded_in:
        s, t = folded_in[1], folded_in[2]
    return mean, rstd, s, t


def _norm_state_fake(x: Tensor, m: int, n: int, layernorm: bool, given_stats: bool, given_fold: bool):
    return (_empty_f32(x, 0 if given_stats or not layernorm else m), _empty_f32(x, 0 if given_stats else m),
            _empty_f32(x, 0 if given_fold or not layernorm else n), _empty_f32(x, 0 if given_fold else n))


# -- norm_linear: act(Norm(x)·Wᵀ + b)

@torch.library.custom_op("coda::norm_linear", mutates_args=())
def _norm_linear(x: Tensor, norm_weight: Tensor, norm_bias: Optional[Tensor], weight: Tensor, bias: Optional[Tensor],
                 mean: Optional[Tensor], rstd: Optional[Tensor], folded: List[Tensor], layernorm: bool,
                 eps: float, activation: int, save_pre_act: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                           Tensor]:
    # x (M, K), norm_weight/norm_bias (K), weight (N, K), bias (N), mean/rstd (M) fp32 or None
    # folded: [W̃, s, t] from _fold_cache, or [] to fold here
    #   -> y (M, N), pre_act (M, N) or (0,), then mean (M), rstd (M), col_sum s (N), shift t (N), each (0,)
    #      where not used (mean, s: RMSNorm) or already an input (_not_given)
    save = save_pre_act and activation != _activations.IDENTITY
    fused = x.shape[0] > 0 and _kernels.norm_usable([x, norm_weight, norm_bias, weight, bias],
                                                    [x.shape[1], weight.shape[0]])
    if fused:
        x = _kernels.rows(x)
    given, given_fold = (mean, rstd), len(folded) > 0
    mean, rstd = _stats_for(x, mean, rstd, layernorm, eps, fused)
    folded, s, t = _fold(weight, norm_weight, norm_bias, bias, layernorm, fused, folded)
    state = _not_given((mean, rstd), (s, t), given[1] is not None, given_fold)
    if fused:
        y, h = torch.ops.coda.gemm_norm_linear(x, folded, mean if layernorm else None,
                                               _forward_rstd(rstd, eps, layernorm), s if layernorm else None, t,
                                               activation, save)
        return y, h, *state
    # the reference normalizes in x's precision unless stats were given
    h = reference.normalize(x, norm_weight, norm_bias, eps, layernorm, *given)
    y, h = reference.linear_forward(h, weight, bias, activation, save)
    return y, h, *state


@_norm_linear.register_fake
def _(x, norm_weight, norm_bias, weight, bias, mean, rstd, folded, layernorm, eps, activation, save_pre_act):
    save = save_pre_act and activation != _activations.IDENTITY
    m, n = x.shape[0], weight.shape[0]
    return (x.new_empty(m, n), x.new_empty(m, n) if save else x.new_empty(0),
            *_norm_state_fake(x, m, n, layernorm, rstd is not None, len(folded) > 0))


@torch.library.custom_op("coda::norm_linear_backward", mutates_args=())
def _norm_linear_backward(dy: Tensor, x: Tensor, norm_weight: Tensor, norm_bias: Optional[Tensor], weight: Tensor,
                          has_bias: bool, pre_act: Tensor, mean: Tensor, rstd: Tensor, col_sum: Tensor, shift: Tensor,
                          layernorm: bool, eps: float, activation: int,
                          needs: List[bool]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    # pre_act: H, or the output y when the activation is identity
    # -> dx (M, K), dnorm_weight (K), dnorm_bias (K), dweight (N, K), dbias (N); (0,) when not needed
    need_dx, need_dnw, need_dnb, need_dw, need_db = needs
    fused = x.shape[0] > 0 and _kernels.norm_usable([x, norm_weight, norm_bias, weight, dy, pre_act],
                                                    [x.shape[1], weight.shape[0]])
    if not fused:
        return reference.norm_linear_backward(dy, x, norm_weight, norm_bias, weight, has_bias, pre_act, layernorm,
                                              eps, activation, needs)
    dy, x = _kernels.rows(dy), _kernels.rows(x)
    d = x.shape[1]
    # One pass over dy and H: dP = dy ⊙ act'(H), c₁, c₂ and the bias gradient
    # (no GEMM of a lone norm-linear has dP as its output, so no epilogue can take them).
    want_db = has_bias and need_db
    dp, c1, c2, db = torch.ops.coda.norm_row_dots(dy, pre_act, activation, shift, col_sum if layernorm else None,
                                                  1.0 / d, want_db)
    if activation == _activations.IDENTITY:
        dp = dy
    dx, nhat, dnw, dnb = torch.ops.coda.gemm_norm_dgrad(
        dp, weight.contiguous(), x, mean if layernorm else None, rstd, norm_weight.contiguous(), _contig(norm_bias),
        c1, c2 if layernorm else None, None, need_dw, need_dnw or need_dnb)
    dw = torch.ops.coda.gemm_wgrad(dp, nhat) if need_dw else _empty(dy)
    return dx, dnw, dnb, dw, db if want_db else _empty(dy)


@_norm_linear_backward.register_fake
def _(dy, x, norm_weight, norm_bias, weight, has_bias, pre_act, mean, rstd, col_sum, shift, layernorm, eps,
      activation, needs):
    e = x.new_empty
    need_dx, need_dnw, need_dnb, need_dw, need_db = needs
    return (e(x.shape) if need_dx else e(0), e(norm_weight.shape) if need_dnw else e(0),
            e(norm_weight.shape) if need_dnb and norm_bias is not None else e(0),
            e(weight.shape) if need_dw else e(0), e(weight.shape[0]) if need_db and has_bias else e(0))


def _norm_linear_setup(ctx, inputs, output):
    x, norm_weight, norm_bias, weight, bias, mean_in, rstd_in, folded, layernorm, eps, activation, _ = inputs
    y, h = output[:2]
    mean, rstd, s, t = _saved_norm_state(mean_in, rstd_in, folded, output[2:])
    ctx.n_folded = len(folded)
    pre = y if activation == _activations.IDENTITY else h
    ctx.save_for_backward(x, norm_weight, norm_bias, weight, pre, mean, rstd, s, t)
    _state_outputs(ctx, output[1:])
    ctx.has_bias, ctx.layernorm, ctx.eps, ctx.activation = bias is not None, layernorm, eps, activation


def _norm_linear_grad(ctx, dy, *_):
    if dy is None:
        return (None,) * 7 + ([None] * ctx.n_folded,) + (None,) * 4
    x, norm_weight, norm_bias, weight, pre, mean, rstd, s, t = ctx.saved_tensors
    if pre.numel() != x.shape[0] * weight.shape[0]:
        raise RuntimeError("coda.norm_linear: backward needs the pre-activation, which was not saved "
                           "(no input required grad when the forward ran)")
    need = ctx.needs_input_grad
    needs = [need[0], need[1], need[2] and norm_bias is not None, need[3], need[4] and ctx.has_bias]
    dx, dnw, dnb, dw, db = _norm_linear_backward(dy, x, norm_weight, norm_bias, weight, ctx.has_bias, pre, mean, rstd,
                                                 s, t, ctx.layernorm, ctx.eps, ctx.activation, needs)
    return (dx if needs[0] else None, dnw if needs[1] else None, dnb if needs[2] else None,
            dw if needs[3] else None, db if needs[4] else None, None, None, [None] * ctx.n_folded, None, None, None,
            None)


_norm_linear.register_autograd(_norm_linear_grad, setup_context=_norm_linear_setup)


def _norm_linear_call(x, norm_weight, norm_bias, weight, bias, eps, activation, stats, layernorm, op):
    _check_x(x, op)
    d = x.shape[-1]
    _check_norm_params("norm_weight" if not layernorm else "ln_weight", norm_weight, d, x, op, True)
    _check_norm_params("ln_bias", norm_bias, d, x, op, False)
    _check_weight("weight", weight, d, x, op)
    _check_bias("bias", bias, weight.shape[0], x, op)
    _check_stats(stats, x, op)
    mean, rstd = _split_stats(stats, layernorm)
    act = _activations.code(activation)
    cached = None if x.device.type != "cuda" else _fold_cache.lookup(weight, norm_weight, norm_bias, bias)
    y = _norm_linear(_rows(x), norm_weight, norm_bias, weight, bias, mean, rstd,
                     [] if cached is None else list(cached), layernorm, float(eps), act,
                     _needs_grad(x, norm_weight, norm_bias, weight, bias))[0]
    return y.reshape(*x.shape[:-1], weight.shape[0])


def layernorm_linear(x: Tensor, ln_weight: Tensor, ln_bias: Optional[Tensor], weight: Tensor,
                     bias: Optional[Tensor] = None, eps: float = 1e-5, activation: Optional[str] = None,
                     stats: Optional[Tensor] = None) -> Tensor:
    """act(LayerNorm(x)·weightᵀ + bias) in one GEMM: the norm is folded into it.

    x: (..., D); ln_weight, ln_bias: (D,); weight: (N, D); bias: (N,) or None;
    stats: optional float32 (..., 2) per-row (mean, rstd) of x, e.g. from
    linear_residual; without it one light pass over x computes them.
    """
    return _norm_linear_call(x, ln_weight, ln_bias, weight, bias, eps, activation, stats, True, "layernorm_linear")


def rmsnorm_linear(x: Tensor, norm_weight: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                   eps: float = 1e-6, activation: Optional[str] = None, stats: Optional[Tensor] = None) -> Tensor:
    """act(RMSNorm(x)·weightᵀ + bias) in one GEMM. stats: optional float32 (..., 2), (0, rstd) per row."""
    return _norm_linear_call(x, norm_weight, None, weight, bias, eps, activation, stats, False, "rmsnorm_linear")


# -- norm_mlp: fc2(act(fc1(Norm(x)))) + residual

@torch.library.custom_op("coda::norm_mlp", mutates_args=())
def _norm_mlp(x: Tensor, norm_weight: Tensor, norm_bias: Optional[Tensor], w1: Tensor, b1: Optional[Tensor],
              w2: Tensor, b2: Optional[Tensor], mean: Optional[Tensor], rstd: Optional[Tensor],
              folded: List[Tensor], residual: Optional[Tensor], add_input: bool, layernorm: bool, eps: float, activation: int,
              save_for_backward: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    # x (M, D), w1 (F, D), w2 (D', F); add_input: x itself is the residual (x + MLP(Norm(x)))
    #   -> y (M, D'), h1 (M, F) or (0,), a1 (M, F) or (0,), mean, rstd, s, t as in norm_linear
    save_h = save_for_backward and activation != _activations.IDENTITY
    fused = x.shape[0] > 0 and _kernels.norm_usable([x, norm_weight, norm_bias, w1, b1, w2, b2, residual],
                                                    [x.shape[1], w1.shape[0], w2.shape[0]])
    if fused:
        x = _kernels.rows(x)
    given, given_fold = (mean, rstd), len(folded) > 0
    mean, rstd = _stats_for(x, mean, rstd, layernorm, eps, fused)
    folded, s, t = _fold(w1, norm_weight, norm_bias, b1, layernorm, fused, folded)
    state = _not_given((mean, rstd), (s, t), given[1] is not None, given_fold)
    res = x if add_input else residual
    if fused:
        a1, h1 = torch.ops.coda.gemm_norm_linear(x, folded, mean if layernorm else None,
                                                 _forward_rstd(rstd, eps, layernorm), s if layernorm else None, t,
                                                 activation, save_h)
        y, _ = torch.ops.coda.gemm_linear(a1, w2.contiguous(), _contig(b2),
                                          None if res is None else _kernels.rows(res), 0, False)
    else:
        n = reference.normalize(x, norm_weight, norm_bias, eps, layernorm, *given)
        y, h1, a1 = reference.mlp_forward(n, w1, b1, w2, b2, res, activation, save_for_backward)
        if not save_h:
            h1 = x.new_empty(0)
    return y, h1, (a1 if save_for_backward else _empty(x)), *state


@_norm_mlp.register_fake
def _(x, norm_weight, norm_bias, w1, b1, w2, b2, mean, rstd, folded, residual, add_input, layernorm, eps, activation,
      save_for_backward):
    m, f = x.shape[0], w1.shape[0]
    save_h = save_for_backward and activation != _activations.IDENTITY
    return (x.new_empty(m, w2.shape[0]), x.new_empty(m, f) if save_h else x.new_empty(0),
            x.new_empty(m, f) if save_for_backward else x.new_empty(0),
            *_norm_state_fake(x, m, f, layernorm, rstd is not None, len(folded) > 0))


@torch.library.custom_op("coda::norm_mlp_backward", mutates_args=())
def _norm_mlp_backward(dy: Tensor, x: Tensor, norm_weight: Tensor, norm_bias: Optional[Tensor], w1: Tensor,
                       w2: Tensor, h1: Tensor, a1: Tensor, mean: Tensor, rstd: Tensor, col_sum: Tensor,
                       shift: Tensor, has_b1: bool, has_b2: bool, add_input: bool, layernorm: bool, eps: float,
                       activation: int, needs: List[bool]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                    Tensor]:
    # h1: the pre-activation, or a1 when the activation is identity
    # -> dx, dnorm_weight, dnorm_bias, dw1, db1, dw2, db2; (0,) when not needed
    need_dx, need_dnw, need_dnb, need_dw1, need_db1, need_dw2, need_db2 = needs
    fused = x.shape[0] > 0 and _kernels.norm_usable([x, norm_weight, norm_bias, w1, w2, dy, h1, a1],
                                                    [x.shape[1], w1.shape[0], w2.shape[0]])
    if not fused:
        return reference.norm_mlp_backward(dy, x, norm_weight, norm_bias, w1, w2, h1, a1, has_b1, has_b2, add_input,
                                           layernorm, eps, activation, needs)
    dy, x = _kernels.rows(dy), _kernels.rows(x)
    dw2 = torch.ops.coda.gemm_wgrad(dy, a1) if need_dw2 else _empty(dy)
    db2 = reference.bias_grad(dy) if has_b2 and need_db2 else _empty(dy)
    # fc2's dgrad epilogue: act', db1 and the norm's row dots c₁, c₂ in one pass.
    dh1, db1, c1, c2 = torch.ops.coda.gemm_dgrad_rowdot(dy, w2.contiguous(), h1, activation, has_b1 and need_db1,
                                                        shift, col_sum if layernorm else None, 1.0 / x.shape[1])
    # fc1's dgrad epilogue: the norm's backward, dγ, dβ, N̂ for dw1, and the
    # residual's gradient when x is its own residual.
    dx, nhat, dnw, dnb = torch.ops.coda.gemm_norm_dgrad(
        dh1, w1.contiguous(), x, mean if layernorm else None, rstd, norm_weight.contiguous(), _contig(norm_bias),
        c1, c2 if layernorm else None, dy if add_input else None, need_dw1, need_dnw or need_dnb)
    dw1 = torch.ops.coda.gemm_wgrad(dh1, nhat) if need_dw1 else _empty(dy)
    return dx, dnw, dnb, dw1, db1, dw2, db2


@_norm_mlp_backward.register_fake
def _(dy, x, norm_weight, norm_bias, w1, w2, h1, a1, mean, rstd, col_sum, shift, has_b1, has_b2, add_input,
      layernorm, eps, activation, needs):
    e = x.new_empty
    need_dx, need_dnw, need_dnb, need_dw1, need_db1, need_dw2, need_db2 = needs
    return (e(x.shape) if need_dx else e(0), e(norm_weight.shape) if need_dnw else e(0),
            e(norm_weight.shape) if need_dnb and norm_bias is not None else e(0),
            e(w1.shape) if need_dw1 else e(0), e(w1.shape[0]) if need_db1 and has_b1 else e(0),
            e(w2.shape) if need_dw2 else e(0), e(w2.shape[0]) if need_db2 and has_b2 else e(0))


def _norm_mlp_setup(ctx, inputs, output):
    x, norm_weight, norm_bias, w1, b1, w2, b2, mean_in, rstd_in, folded, residual, add_input, layernorm, eps, \
        activation, _ = inputs
    ctx.n_folded = len(folded)
    _, h1, a1 = output[:3]
    mean, rstd, s, t = _saved_norm_state(mean_in, rstd_in, folded, output[3:])
    ctx.save_for_backward(x, norm_weight, norm_bias, w1, w2, h1, a1, mean, rstd, s, t)
    _state_outputs(ctx, output[1:])
    ctx.has_b1, ctx.has_b2, ctx.has_residual = b1 is not None, b2 is not None, residual is not None
    ctx.add_input, ctx.layernorm, ctx.eps, ctx.activation = add_input, layernorm, eps, activation


def _norm_mlp_grad(ctx, dy, *_):
    if dy is None:
        return (None,) * 9 + ([None] * ctx.n_folded,) + (None,) * 6
    x, norm_weight, norm_bias, w1, w2, h1, a1, mean, rstd, s, t = ctx.saved_tensors
    if a1.numel() != x.shape[0] * w1.shape[0]:
        raise RuntimeError("coda.norm_mlp: backward needs the saved activations, which were not kept "
                           "(no input required grad when the forward ran)")
    if ctx.activation == _activations.IDENTITY:
        h1 = a1
    n = ctx.needs_input_grad
    needs = [n[0], n[1], n[2] and norm_bias is not None, n[3], n[4] and ctx.has_b1, n[5], n[6] and ctx.has_b2]
    dx, dnw, dnb, dw1, db1, dw2, db2 = _norm_mlp_backward(
        dy, x, norm_weight, norm_bias, w1, w2, h1, a1, mean, rstd, s, t, ctx.has_b1, ctx.has_b2, ctx.add_input,
        ctx.layernorm, ctx.eps, ctx.activation, needs)
    grads = [g if need else None for g, need in zip((dx, dnw, dnb, dw1, db1, dw2, db2), needs)]
    return (*grads, None, None, [None] * ctx.n_folded, dy if ctx.has_residual and n[10] else None, None, None, None,
            None, None)


_norm_mlp.register_autograd(_norm_mlp_grad, setup_context=_norm_mlp_setup)


def norm_mlp(x: Tensor, norm_weight: Tensor, norm_bias: Optional[Tensor], w1: Tensor, b1: Optional[Tensor],
             w2: Tensor, b2: Optional[Tensor], normalization: str = "LayerNorm", eps: float = 1e-5,
             activation: Optional[str] = "gelu_tanh", residual: Optional[Tensor] = None,
             stats: Optional[Tensor] = None) -> Tensor:
    """fc2(act(fc1(Norm(x)))) + residual: the norm folded into fc1, everything else in epilogues.

    x: (..., D); norm_weight, norm_bias: (D,) (norm_bias None for RMSNorm);
    w1: (F, D); b1: (F,) or None; w2: (D', F); b2: (D',) or None; residual:
    (..., D') or None — passing x itself (the pre-norm block x + MLP(Norm(x)))
    also folds the residual's gradient into fc1's dgrad epilogue; stats:
    optional float32 (..., 2) per-row (mean, rstd) of x.
    """
    op = "norm_mlp"
    layernorm = _norm_kind(normalization, op) == "layernorm"
    _check_x(x, op)
    d = x.shape[-1]
    _check_norm_params("norm_weight", norm_weight, d, x, op, True)
    if norm_bias is not None and not layernorm:
        raise ValueError("coda.norm_mlp: norm_bias must be None for RMSNorm")
    _check_norm_params("norm_bias", norm_bias, d, x, op, False)
    _check_weight("w1", w1, d, x, op)
    _check_bias("b1", b1, w1.shape[0], x, op)
    _check_weight("w2", w2, w1.shape[0], x, op)
    _check_bias("b2", b2, w2.shape[0], x, op)
    _check_stats(stats, x, op)
    out_shape = (*x.shape[:-1], w2.shape[0])
    add_input = residual is x and w2.shape[0] == d
    if residual is not None:
        if tuple(residual.shape) != out_shape:
            raise ValueError(f"coda.norm_mlp: residual must have shape {out_shape}, got {tuple(residual.shape)}")
        _check_same("residual", residual, x, op)
    mean, rstd = _split_stats(stats, layernorm)
    act = _activations.code(activation)
    res = None if residual is None or add_input else _rows(residual)
    cached = None if x.device.type != "cuda" else _fold_cache.lookup(w1, norm_weight, norm_bias, b1)
    y = _norm_mlp(_rows(x), norm_weight, norm_bias, w1, b1, w2, b2, mean, rstd,
                  [] if cached is None else list(cached), res, add_input, layernorm, float(eps), act,
                  _needs_grad(x, norm_weight, norm_bias, w1, b1, w2, b2, res))[0]
    return y.reshape(out_shape)


# -- residual-reduce: Y = x·Wᵀ + b + R and the next norm's row statistics

@torch.library.custom_op("coda::linear_residual", mutates_args=())
def _linear_residual(x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Tensor, layernorm: bool,
                     eps: float) -> Tuple[Tensor, Tensor, Tensor]:
    # x (M, K), weight (N, K), bias (N), residual (M, N) -> y (M, N), mean (M) or (0,), rstd (M), fp32
    if x.shape[0] and _kernels.norm_usable([x, weight, bias, residual], [x.shape[1], weight.shape[0]]):
        return torch.ops.coda.gemm_linear_residual(_kernels.rows(x), weight.contiguous(), _contig(bias),
                                                   _kernels.rows(residual), layernorm, eps)
    y = F.linear(x, weight, bias) + residual
    mean, rstd = reference.row_stats(y, layernorm, eps)
    return y, (mean if layernorm else _empty_f32(x)), rstd


@_linear_residual.register_fake
def _(x, weight, bias, residual, layernorm, eps):
    m = x.shape[0]
    return x.new_empty(m, weight.shape[0]), _empty_f32(x, m if layernorm else 0), _empty_f32(x, m)


def _linear_residual_setup(ctx, inputs, output):
    x, weight, bias, _, _, _ = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None
    _state_outputs(ctx, output[1:])


def _linear_residual_grad(ctx, dy, _dmean, _drstd):
    if dy is None:
        return (None,) * 6
    x, weight = ctx.saved_tensors
    need = ctx.needs_input_grad
    dx, dw, db = _linear_backward(dy, x, weight, _empty(x), _activations.IDENTITY, ctx.has_bias and need[2],
                                  need[0], need[1])
    return (dx if need[0] else None, dw if need[1] else None, db if ctx.has_bias and need[2] else None,
            dy if need[3] else None, None, None)


_linear_residual.register_autograd(_linear_residual_grad, setup_context=_linear_residual_setup)


def linear_residual(x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Tensor,
                    normalization: str = "LayerNorm", eps: float = 1e-5) -> Tuple[Tensor, Tensor]:
    """Y = x·weightᵀ + bias + residual, and the row statistics the next norm needs, in one GEMM.

    Returns (Y (..., N), stats float32 (..., 2)): per row (mean, rstd) for
    LayerNorm, (0, rstd) for RMSNorm, reduced in the GEMM's epilogue, for
    layernorm_linear / rmsnorm_linear / norm_mlp. The statistics carry no
    gradient: those ops' backward treats them as functions of Y.
    """
    op = "linear_residual"
    _check_x(x, op)
    _check_weight("weight", weight, x.shape[-1], x, op)
    _check_bias("bias", bias, weight.shape[0], x, op)
    out_shape = (*x.shape[:-1], weight.shape[0])
    if not isinstance(residual, Tensor) or tuple(residual.shape) != out_shape:
        got = tuple(residual.shape) if isinstance(residual, Tensor) else type(residual).__name__
        raise ValueError(f"coda.linear_residual: residual must have shape {out_shape}, got {got}")
    _check_same("residual", residual, x, op)
    layernorm = _norm_kind(normalization, op) == "layernorm"
    y, mean, rstd = _linear_residual(_rows(x), weight, bias, _rows(residual), layernorm, float(eps))
    return y.reshape(out_shape), _pack_stats(mean, rstd, layernorm, out_shape[:-1])


def row_stats(y: Tensor, normalization: str = "LayerNorm", eps: float = 1e-5) -> Tensor:
    """(..., F) -> float32 (..., 2): per row (mean, rstd) for LayerNorm, (0, rstd) for RMSNorm."""
    layernorm = _norm_kind(normalization, "row_stats") == "layernorm"
    y = y.detach()
    rows = _rows(y)
    if rows.shape[0] and _kernels.norm_usable([rows], [rows.shape[1]]):
        mean, rstd = torch.ops.coda.norm_row_stats(_kernels.rows(rows), layernorm, float(eps))
    else:
        mean, rstd = reference.row_stats(rows, layernorm, eps)
    return _pack_stats(mean, rstd, layernorm, y.shape[:-1])


def _pack_stats(mean: Optional[Tensor], rstd: Tensor, layernorm: bool, lead: Tuple[int, ...]) -> Tensor:
    """(mean or 0, rstd) per row as float32 (..., 2), stored as the transpose of
    a (2, rows) tensor: the norm ops read each column as a contiguous vector
    (_split_stats), with no copy."""
    mean = mean if layernorm else torch.zeros_like(rstd)
    return torch.stack([mean, rstd]).t().reshape(*lead, 2)
