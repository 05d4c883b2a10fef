"""Gated MLPs (SwiGLU, GeGLU), LLaMA's MLP: down(act(gate(n)) ⊙ up(n)) + residual,
n = x or RMSNorm(x) / LayerNorm(x), and the weight layouts the kernels will read.

Kernels: not built yet (issue 24, design in benchmarks/design/llama/). Every call
runs the reference path; on CUDA tensors that is a visible fallback (a one-time
coda.FallbackWarning, an error in strict mode), as for any shape a kernel cannot
take. The functions' signatures and the modules' parameters are the ones the
kernels will serve.

Layout inside coda: the gate/up GEMM reads one (2F, D) weight whose rows
alternate gate and up (row 2j = gate[j], row 2j + 1 = up[j]), so that one
output tile holds each (g, u) pair in adjacent columns and its epilogue writes
act(g)·u. Checkpoints keep their own layout: Hugging Face's separate gate_proj /
up_proj, or a concatenated [gate; up] (Phi-3's gate_up_proj); the helpers here
convert both ways.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _activations, _kernels
from . import _checks
from .norm import normalize_reference, _to_rows

__all__ = ["glu_mlp", "norm_glu_mlp", "glu_mlp_reference", "norm_glu_mlp_reference", "interleave_gate_up",
           "split_gate_up", "concatenated_to_interleaved", "interleaved_to_concatenated"]

# The activations a gate takes: SwiGLU (LLaMA, Mistral, Qwen) and GeGLU (Gemma's tanh form, or erf).
GATE_ACTIVATIONS = ("silu", "swish", "gelu_tanh", "gelu_pytorch_tanh", "gelu_new", "gelu", "gelu_erf")


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


# ---- the ops

def _gate_code(activation: Optional[str], op: str) -> int:
    key = activation.lower() if isinstance(activation, str) else activation
    if key not in GATE_ACTIVATIONS:
        raise ValueError(f"coda.{op}: activation must be one of {list(GATE_ACTIVATIONS)} (the gate's), "
                         f"got {activation!r}")
    return _activations.code(key)


def glu_mlp_reference(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, activation: str = "silu",
                      residual: Optional[Tensor] = None) -> Tensor:
    """down(act(x·gateᵀ) ⊙ x·upᵀ) (+ residual), unfused, as Hugging Face's LlamaMLP computes it."""
    a = _activations.apply(F.linear(x, w_gate), _gate_code(activation, "glu_mlp")) * F.linear(x, w_up)
    y = F.linear(a, w_down)
    return y if residual is None else y + residual


def norm_glu_mlp_reference(x: Tensor, norm_weight: Tensor, norm_bias: Optional[Tensor], w_gate: Tensor,
                           w_up: Tensor, w_down: Tensor, normalization: str = "RMSNorm",
                           eps: Optional[float] = None, activation: str = "silu",
                           residual: Optional[Tensor] = None, stats: Optional[Tensor] = None) -> Tensor:
    """glu_mlp_reference of Norm(x); stats as the fused ops take them."""
    layernorm = _checks.layernorm(normalization, "norm_glu_mlp")
    eps = _checks.eps_of(eps, layernorm, x, "norm_glu_mlp")
    n = normalize_reference(x, norm_weight, norm_bias, eps, layernorm, _to_rows(stats))
    return glu_mlp_reference(n, w_gate, w_up, w_down, activation, residual)


def _check_glu(op: str, x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, residual: Optional[Tensor]):
    _checks.x_input(x, op)
    _checks.weight("w_gate", w_gate, x.shape[-1], op, "x", x.shape)
    _checks.weight("w_up", w_up, x.shape[-1], op, "x", x.shape)
    if w_up.shape != w_gate.shape:
        raise ValueError(f"coda.{op}: w_up {tuple(w_up.shape)} must have w_gate's shape {tuple(w_gate.shape)}")
    _checks.weight("w_down", w_down, w_gate.shape[0], op, "the gated activation (w_gate)",
                   (*x.shape[:-1], w_gate.shape[0]))
    if residual is not None:
        _checks.matrix_like("residual", residual, (*x.shape[:-1], w_down.shape[0]), op)


def _no_kernel(op: str, x: Tensor) -> None:
    if x.device.type == "cuda":
        _kernels.fallback(op, "its kernels are not built yet (the LLaMA path, issue 24)")


def glu_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, activation: str = "silu",
            residual: Optional[Tensor] = None) -> Tensor:
    """down(act(x·gateᵀ) ⊙ x·upᵀ) + residual: SwiGLU with "silu", GeGLU with "gelu_tanh" / "gelu".

    x: (..., D); w_gate, w_up: (F, D) (Hugging Face's gate_proj / up_proj weights);
    w_down: (E, F); residual: (..., E) or None. Returns (..., E).
    """
    op = "glu_mlp"
    _check_glu(op, x, w_gate, w_up, w_down, residual)
    _gate_code(activation, op)
    _no_kernel(op, x)
    return glu_mlp_reference(x, w_gate, w_up, w_down, activation, residual)


def norm_glu_mlp(x: Tensor, norm_weight: Tensor, norm_bias: Optional[Tensor], w_gate: Tensor, w_up: Tensor,
                 w_down: Tensor, normalization: str = "RMSNorm", eps: Optional[float] = None,
                 activation: str = "silu", residual: Optional[Tensor] = None,
                 stats: Optional[Tensor] = None) -> Tensor:
    """glu_mlp(Norm(x)) + residual, the norm to be folded into the gate/up GEMM as
    norm_mlp folds it: LLaMA's post-attention RMSNorm and MLP in one op.

    norm_weight, norm_bias: (D,) (norm_bias None for RMSNorm); eps None: the
    norm's default (1e-5 LayerNorm, machine epsilon RMSNorm); stats: optional
    float32 (..., 2) per-row (mean, rstd) of x, e.g. from linear_residual.
    """
    op = "norm_glu_mlp"
    layernorm = _checks.layernorm(normalization, op)
    _check_glu(op, x, w_gate, w_up, w_down, residual)
    if norm_weight is None:
        raise ValueError(f"coda.{op}: norm_weight is required")
    _checks.vector("norm_weight", norm_weight, x.shape[-1], op, f" (the last dimension of x, {tuple(x.shape)})")
    if norm_bias is not None and not layernorm:
        raise ValueError(f"coda.{op}: norm_bias must be None for RMSNorm")
    _checks.vector("norm_bias", norm_bias, x.shape[-1], op, f" (the last dimension of x, {tuple(x.shape)})")
    _checks.stats(stats, x, op)
    _gate_code(activation, op)
    _checks.eps_of(eps, layernorm, x, op)
    _no_kernel(op, x)
    return norm_glu_mlp_reference(x, norm_weight, norm_bias, w_gate, w_up, w_down, normalization, eps, activation,
                                  residual, stats)
