"""Gated MLPs (SwiGLU, GeGLU), LLaMA's MLP: down(act(gate(n)) ⊙ up(n)) + residual,
n = x or RMSNorm(x) / LayerNorm(x), and the weight layout the kernels read.

Layout inside coda: the gate/up GEMM reads one (2F, D) weight `w_gate_up` whose
rows alternate gate and up (row 2j = gate[j], row 2j + 1 = up[j]), so that one
output tile holds each (g, u) pair in adjacent columns and its epilogue writes
act(g)·u. Checkpoints keep their own layout: Hugging Face's separate gate_proj /
up_proj, or a concatenated [gate; up] (Phi-3's gate_up_proj); the helpers here
convert both ways (coda.nn.SwiGLUMLP does it in its state_dict hooks).

One C++ op per direction (torch.ops.coda.norm_glu_mlp / norm_glu_mlp_backward,
whose fakes are here; autograd in C++), serving both functions: glu_mlp passes
no norm weight. Kernels: bf16, RMSNorm or no norm. LayerNorm, other dtypes and
CPU tensors run the reference path (visibly on CUDA: coda.FallbackWarning).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _activations, _kernels
from . import _checks
from ._common import autocast, rows
from .norm import _f32, _row_stats_reference, _stats_fake, _to_rows, _to_user, normalize_reference

__all__ = ["glu_mlp", "norm_glu_mlp", "glu_mlp_reference", "norm_glu_mlp_reference", "interleave_gate_up",
           "split_gate_up", "concatenated_to_interleaved", "interleaved_to_concatenated"]

if _kernels.available():
    @torch.library.register_fake("coda::norm_glu_mlp")
    def _(x, norm_weight, w_gate_up, w_down, stats, residual, add_input, eps, activation, save, want_stats):
        m, f2 = math.prod(x.shape[:-1]), w_gate_up.shape[0]
        return (x.new_empty(*x.shape[:-1], w_down.shape[0]),
                x.new_empty(m, f2) if save else x.new_empty(0),
                x.new_empty(m, f2 // 2) if save else x.new_empty(0),
                _stats_fake(x, m) if norm_weight is not None and stats is None else _f32(x),
                _stats_fake(x, m) if want_stats else _f32(x))

    @torch.library.register_fake("coda::norm_glu_mlp_backward")
    def _(dy, x, norm_weight, w_gate_up, w_down, h, a, stats, add_input, activation, needs):
        e = x.new_empty
        return (e(x.shape) if needs[0] else e(0), e(x.shape[-1]) if needs[1] else e(0),
                e(w_gate_up.shape) if needs[2] else e(0), e(w_down.shape) if needs[3] else e(0))


# ---- weight layouts

def interleave_gate_up(w_gate: Tensor, w_up: Tensor) -> Tensor:
    """(F, D) gate and up weights (or (F,) biases) -> coda's (2F, ...) layout, rows
    g0, u0, g1, u1, ...: a copy."""
    if w_gate.shape != w_up.shape:
        raise ValueError(f"coda.interleave_gate_up: w_gate {tuple(w_gate.shape)} and w_up {tuple(w_up.shape)} "
                         f"must have the same shape")
    return torch.stack([w_gate, w_up], dim=1).reshape(2 * w_gate.shape[0], *w_gate.shape[1:])


def split_gate_up(w: Tensor) -> Tuple[Tensor, Tensor]:
    """coda's interleaved (2F, ...) -> (gate, up), views of w."""
    if w.shape[0] % 2:
        raise ValueError(f"coda.split_gate_up: w must have an even first dimension (2F, ...), got {tuple(w.shape)}")
    return w[0::2], w[1::2]


def concatenated_to_interleaved(w: Tensor) -> Tensor:
    """A concatenated [gate; up] (2F, ...) weight, as some checkpoints fuse it -> coda's layout."""
    if w.shape[0] % 2:
        raise ValueError(f"coda.concatenated_to_interleaved: w must be [gate; up] (2F, ...), got {tuple(w.shape)}")
    f = w.shape[0] // 2
    return interleave_gate_up(w[:f], w[f:])


def interleaved_to_concatenated(w: Tensor) -> Tensor:
    """coda's layout -> a concatenated [gate; up] (2F, ...) copy."""
    gate, up = split_gate_up(w)
    return torch.cat([gate, up], dim=0)


# ---- references

def glu_mlp_reference(x: Tensor, w_gate_up: Tensor, w_down: Tensor, activation: str = "silu",
                      residual: Optional[Tensor] = None) -> Tensor:
    """down(act(x·gateᵀ) ⊙ x·upᵀ) (+ residual), unfused, as Hugging Face's LlamaMLP computes it."""
    w_gate, w_up = split_gate_up(w_gate_up)
    a = _activations.apply(F.linear(x, w_gate), _checks.gate_code(activation, "glu_mlp")) * F.linear(x, w_up)
    y = F.linear(a, w_down)
    return y if residual is None else y + residual


def norm_glu_mlp_reference(x: Tensor, norm_weight: Tensor, norm_bias: Optional[Tensor], w_gate_up: Tensor,
                           w_down: Tensor, normalization: str = "RMSNorm", eps: Optional[float] = None,
                           activation: str = "silu", residual: Optional[Tensor] = None,
                           stats: Optional[Tensor] = None,
                           return_stats: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """glu_mlp_reference of Norm(x); stats and return_stats as norm_glu_mlp takes them."""
    layernorm = _checks.layernorm(normalization, "norm_glu_mlp")
    eps = _checks.eps_of(eps, layernorm, x, "norm_glu_mlp")
    n = normalize_reference(x, norm_weight, norm_bias, eps, layernorm, _to_rows(stats))
    y = glu_mlp_reference(n, w_gate_up, w_down, activation, residual)
    if not return_stats:
        return y
    return y, _to_user(_row_stats_reference(rows(y), layernorm, eps), y.shape[:-1])


# ---- the ops

def _check_glu(op: str, x: Tensor, w_gate_up: Tensor, w_down: Tensor, residual: Optional[Tensor]) -> None:
    _checks.x_input(x, op)
    _checks.weight("w_gate_up", w_gate_up, x.shape[-1], op, "x", x.shape)
    if w_gate_up.shape[0] % 2:
        raise ValueError(f"coda.{op}: w_gate_up must have an even number of rows (2F, D), gate and up interleaved "
                         f"(coda.ops.interleave_gate_up), got {tuple(w_gate_up.shape)}")
    f = w_gate_up.shape[0] // 2
    _checks.weight("w_down", w_down, f, op, "the gated activation (w_gate_up's 2F rows / 2)", (*x.shape[:-1], f))
    if residual is not None:
        _checks.matrix_like("residual", residual, (*x.shape[:-1], w_down.shape[0]), op)


def _use_kernel(op: str, x: Tensor, layernorm: bool, w_gate_up: Tensor, w_down: Tensor) -> bool:
    if layernorm:
        if x.device.type == "cuda":
            _kernels.fallback(op, "LayerNorm has no gated-MLP kernel (RMSNorm has)")
        return False
    if not _kernels.use_kernels(op, x, _kernels.BF16, (x.shape[-1], w_gate_up.shape[0] // 2, w_down.shape[0])):
        return False
    return True


def _run(op: str, x: Tensor, norm_weight: Optional[Tensor], norm_bias: Optional[Tensor], w_gate_up: Tensor,
         w_down: Tensor, layernorm: bool, eps: float, activation: str, residual: Optional[Tensor],
         stats: Optional[Tensor], return_stats: bool):
    """The common tail of glu_mlp and norm_glu_mlp (norm_weight None: no norm)."""
    act = _checks.gate_code(activation, op)
    add_input = residual is x  # still x itself after autocast: the C++ autograd adds dy to dx once
    x, norm_weight, norm_bias, w_gate_up, w_down, residual = autocast(x, norm_weight, norm_bias, w_gate_up, w_down,
                                                                      residual)
    if add_input:
        residual = x
    for name, t in (("norm_weight", norm_weight), ("norm_bias", norm_bias), ("w_gate_up", w_gate_up),
                    ("w_down", w_down), ("residual", residual)):
        if t is not None:
            _checks.like(name, t, x, op)
    if not _use_kernel(op, x, layernorm, w_gate_up, w_down):
        if norm_weight is None:
            return glu_mlp_reference(x, w_gate_up, w_down, activation, residual)
        return norm_glu_mlp_reference(x, norm_weight, norm_bias, w_gate_up, w_down,
                                      "LayerNorm" if layernorm else "RMSNorm", eps, activation, residual, stats,
                                      return_stats)
    y, _, _, _, out_stats = torch.ops.coda.norm_glu_mlp.default(
        x, norm_weight, w_gate_up, w_down, _to_rows(stats), None if add_input else residual, add_input, eps, act,
        False, return_stats)
    return (y, _to_user(out_stats, y.shape[:-1])) if return_stats else y


def glu_mlp(x: Tensor, w_gate_up: Tensor, w_down: Tensor, activation: str = "silu",
            residual: Optional[Tensor] = None) -> Tensor:
    """down(act(x·gateᵀ) ⊙ x·upᵀ) + residual: SwiGLU with "silu", GeGLU with "gelu_tanh" / "gelu".

    x: (..., D); w_gate_up: (2F, D), gate and up rows interleaved
    (interleave_gate_up(gate_proj.weight, up_proj.weight)); w_down: (E, F);
    residual: (..., E) or None (x itself also folds its gradient into the
    gate/up dgrad). Returns (..., E). Two GEMMs: the gate/up GEMM's epilogue
    writes act(g)·u, the down GEMM's adds the residual.
    """
    op = "glu_mlp"
    _check_glu(op, x, w_gate_up, w_down, residual)
    _checks.gate_code(activation, op)
    return _run(op, x, None, None, w_gate_up, w_down, False, 0.0, activation, residual, None, False)


def norm_glu_mlp(x: Tensor, norm_weight: Tensor, norm_bias: Optional[Tensor], w_gate_up: Tensor, w_down: Tensor,
                 normalization: str = "RMSNorm", eps: Optional[float] = None, activation: str = "silu",
                 residual: Optional[Tensor] = None, stats: Optional[Tensor] = None,
                 return_stats: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """glu_mlp(Norm(x)) + residual, the norm folded into the gate/up GEMM as
    norm_mlp folds it: LLaMA's post-attention RMSNorm, MLP and residual in one op.

    x: (..., D); norm_weight, norm_bias: (D,) (norm_bias None for RMSNorm);
    w_gate_up: (2F, D) interleaved; w_down: (E, F); residual: (..., E) or None
    (x itself: the pre-norm block x + MLP(Norm(x))); eps None: the norm's
    default (1e-5 LayerNorm, machine epsilon RMSNorm); stats: optional float32
    (..., 2) per-row (mean, rstd) of x, e.g. from linear_residual. With
    return_stats, returns (y, stats of y (..., 2)): the row statistics of the
    same norm and eps, for the next layer's norm (reduced in the down GEMM's
    epilogue); else y (..., E).
    """
    op = "norm_glu_mlp"
    layernorm = _checks.layernorm(normalization, op)
    _check_glu(op, x, w_gate_up, w_down, residual)
    if norm_weight is None:
        raise ValueError(f"coda.{op}: norm_weight is required (glu_mlp has no norm)")
    _checks.vector("norm_weight", norm_weight, x.shape[-1], op, f" (the last dimension of x, {tuple(x.shape)})")
    if norm_bias is not None and not layernorm:
        raise ValueError(f"coda.{op}: norm_bias must be None for RMSNorm")
    _checks.vector("norm_bias", norm_bias, x.shape[-1], op, f" (the last dimension of x, {tuple(x.shape)})")
    _checks.stats(stats, x, op)
    _checks.gate_code(activation, op)
    eps = _checks.eps_of(eps, layernorm, x, op)
    return _run(op, x, norm_weight, norm_bias, w_gate_up, w_down, layernorm, eps, activation, residual, stats,
                bool(return_stats))
