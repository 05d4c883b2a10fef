"""coda's fused ops: one torch.library op per fused op, forward and backward.

Each public function takes PyTorch's layouts (activations (..., features),
nn.Linear weights (out, in)) and runs one custom op, so torch.compile traces
it whole (fullgraph=True). Kernel-ready CUDA inputs run CUTLASS kernels whose
epilogues do the elementwise work; everything else runs the reference path
in coda.reference, which gives the same answer.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _activations, _kernels, reference

__all__ = ["linear", "mlp"]


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
    ctx.activation = activation
    ctx.has_bias = bias is not None


def _linear_grad(ctx, dy, _dpre_act):
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
    ctx.activation = activation
    ctx.has_b1, ctx.has_b2, ctx.has_residual = b1 is not None, b2 is not None, residual is not None


def _mlp_grad(ctx, dy, _dh1, _da1):
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
