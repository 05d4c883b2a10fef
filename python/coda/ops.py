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
import torch.nn.functional as F
from torch import Tensor

from . import _activations, _kernels, reference

__all__ = ["linear", "mlp", "layernorm_linear", "rmsnorm_linear", "linear_residual", "row_stats"]


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


# ---- norms in front of GEMMs
#
# The API of the norm-GEMM ops. The norm still runs as its own pass here
# (F.layer_norm / F.rms_norm); the GEMM after it is coda's fused one. Folding
# the norm into the GEMM's epilogue (rstd ⊙ (x·(W∘γ)ᵀ − μ·s) + t, see
# tests/test_norm_fold_numerics.py for why γ goes on W) is the next step.

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
    if tuple(stats.shape) != want or stats.dtype != torch.float32:
        raise ValueError(f"coda.{op}: stats must be a float32 tensor of shape {want} (mean, rstd per row), "
                         f"got {stats.dtype} {tuple(stats.shape)}")
    if stats.device != x.device:
        raise ValueError(f"coda.{op}: stats is on {stats.device}, expected {x.device} (the device of x)")


def _normalize(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float, kind: str,
               stats: Optional[Tensor]) -> Tensor:
    d = x.shape[-1]
    if stats is None:
        if kind == "layernorm":
            return F.layer_norm(x, (d,), weight, bias, eps)
        return F.rms_norm(x, (d,), weight, eps)
    # Precomputed (mean, rstd), e.g. from linear_residual: the same math in fp32.
    # Gradients flow to x through x itself; stats are functions of x and are
    # treated as such by the backward (they are recomputed, not differentiated).
    xf = x.float()
    mean, rstd = stats[..., :1], stats[..., 1:]
    if kind == "layernorm":
        with torch.no_grad():
            mean_x = xf.mean(-1, keepdim=True)
            rstd_x = torch.rsqrt(xf.var(-1, unbiased=False, keepdim=True) + eps)
        # value from the given stats, gradient of a true LayerNorm
        y = F.layer_norm(xf, (d,), None, None, eps)
        y = y + ((xf - mean) * rstd - (xf - mean_x) * rstd_x).detach()
    else:
        with torch.no_grad():
            rstd_x = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        y = F.rms_norm(xf, (d,), None, eps)
        y = y + (xf * rstd - xf * rstd_x).detach()
    y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def row_stats(y: Tensor, normalization: str = "LayerNorm", eps: float = 1e-5) -> Tensor:
    """(..., F) -> float32 (..., 2): per row (mean, rstd) for LayerNorm, (0, rstd) for RMSNorm."""
    kind = _norm_kind(normalization, "row_stats")
    yf = y.detach().float()
    if kind == "layernorm":
        mean = yf.mean(-1, keepdim=True)
        rstd = torch.rsqrt(yf.var(-1, unbiased=False, keepdim=True) + eps)
    else:
        mean = torch.zeros_like(yf[..., :1])
        rstd = torch.rsqrt(yf.square().mean(-1, keepdim=True) + eps)
    return torch.cat([mean, rstd], -1)


def layernorm_linear(x: Tensor, ln_weight: Tensor, ln_bias: Optional[Tensor], weight: Tensor,
                     bias: Optional[Tensor] = None, eps: float = 1e-5, activation: Optional[str] = None,
                     stats: Optional[Tensor] = None) -> Tensor:
    """act(LayerNorm(x)·weightᵀ + bias).

    x: (..., D); ln_weight, ln_bias: (D,); weight: (N, D); bias: (N,) or None;
    stats: optional float32 (..., 2) per-row (mean, rstd) from linear_residual.
    """
    _check_x(x, "layernorm_linear")
    _check_norm_params("ln_weight", ln_weight, x.shape[-1], x, "layernorm_linear", True)
    _check_norm_params("ln_bias", ln_bias, x.shape[-1], x, "layernorm_linear", False)
    _check_stats(stats, x, "layernorm_linear")
    return linear(_normalize(x, ln_weight, ln_bias, eps, "layernorm", stats), weight, bias, activation)


def rmsnorm_linear(x: Tensor, norm_weight: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                   eps: float = 1e-6, activation: Optional[str] = None, stats: Optional[Tensor] = None) -> Tensor:
    """act(RMSNorm(x)·weightᵀ + bias). stats: optional float32 (..., 2), (0, rstd) per row."""
    _check_x(x, "rmsnorm_linear")
    _check_norm_params("norm_weight", norm_weight, x.shape[-1], x, "rmsnorm_linear", True)
    _check_stats(stats, x, "rmsnorm_linear")
    return linear(_normalize(x, norm_weight, None, eps, "rmsnorm", stats), weight, bias, activation)


def linear_residual(x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Tensor,
                    normalization: str = "LayerNorm", eps: float = 1e-5) -> Tuple[Tensor, Tensor]:
    """Y = x·weightᵀ + bias + residual, and the row statistics the next norm needs.

    Returns (Y (..., N), stats float32 (..., 2)): per row (mean, rstd) for
    LayerNorm, (0, rstd) for RMSNorm, for layernorm_linear / rmsnorm_linear.
    The statistics carry no gradient: those ops' backward recomputes them.
    """
    _check_x(x, "linear_residual")
    _check_weight("weight", weight, x.shape[-1], x, "linear_residual")
    _check_bias("bias", bias, weight.shape[0], x, "linear_residual")
    out_shape = (*x.shape[:-1], weight.shape[0])
    if not isinstance(residual, Tensor) or tuple(residual.shape) != out_shape:
        got = tuple(residual.shape) if isinstance(residual, Tensor) else type(residual).__name__
        raise ValueError(f"coda.linear_residual: residual must have shape {out_shape}, got {got}")
    _check_same("residual", residual, x, "linear_residual")
    kind = _norm_kind(normalization, "linear_residual")
    y = linear(x, weight, bias) + residual
    return y, row_stats(y, NORMALIZATIONS[kind], eps)
