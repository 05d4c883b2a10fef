"""GPT-2's residual dropout with its residual add (and the next norm's row statistics) in one pass:
y = residual + dropout(x, p), forward and backward.

One C++ op (torch.ops.coda.dropout_residual, its fake here, its autograd in C++) whose mask is a
function of a Philox draw from torch's CUDA generator and of the element (csrc/philox.cuh): the
backward regenerates it from the 16 bytes the forward keeps, and torch.manual_seed fixes it; a
captured CUDA graph draws anew on each replay. The reference path (CPU tensors, other dtypes) is
F.dropout on torch's generator, so it draws what nn.Dropout would.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _kernels
from . import _checks
from .norm import _f32, _row_stats_reference, _stats_fake, _to_user

__all__ = ["dropout_residual", "dropout_residual_reference"]


if _kernels.available():
    @torch.library.register_fake("coda::dropout_residual")
    def _(x, residual, p, want_stats, layernorm, eps):
        m = math.prod(x.shape[:-1])
        return x.new_empty(x.shape), _stats_fake(x, m) if want_stats else _f32(x), x.new_empty(2, dtype=torch.int64)

    @torch.library.register_fake("coda::dropout_backward")
    def _(dy, rng_state, p):
        return dy.new_empty(dy.shape)


def dropout_residual_reference(x: Tensor, residual: Tensor, p: float) -> Tensor:
    """residual + F.dropout(x, p): nn.Dropout's draw from torch's generator, then the add."""
    return residual + F.dropout(x, p, training=True)


def dropout_residual(x: Tensor, residual: Tensor, p: float, normalization: Optional[str] = None,
                     eps: Optional[float] = None) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """residual + dropout(x, p) in one pass (training mode: the caller skips it in eval).

    x, residual: (..., D); p in [0, 1). normalization "LayerNorm" or "RMSNorm" also returns the
    next norm's row statistics of the result, float32 (..., 2) as linear_residual's, for
    layernorm_linear / rmsnorm_linear / norm_mlp (eps: that norm's). Kernels: bf16 / fp16 CUDA
    tensors, D a multiple of 8 (the mask is coda's own draw, not nn.Dropout's); anything else runs
    dropout_residual_reference. Returns the sum, or (sum, stats).
    """
    op = "dropout_residual"
    _checks.x_input(x, op)
    _checks.matrix_like("residual", residual, tuple(x.shape), op)
    if not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ValueError(f"coda.{op}: p must be a float in [0, 1), got {p!r}")
    want_stats = normalization is not None
    layernorm = _checks.layernorm(normalization, op) if want_stats else False
    eps = _checks.eps_of(eps, layernorm, x, op) if want_stats else 0.0
    if residual.device != x.device:
        raise ValueError(f"coda.{op}: residual is on {residual.device}, expected {x.device} (the device of x)")
    lead = x.shape[:-1]
    if residual.dtype != x.dtype or not _kernels.use_kernels(op, x, _kernels.BF16_FP16, (x.shape[-1],)):
        y = dropout_residual_reference(x, residual, p)
        return (y, _to_user(_row_stats_reference(y.reshape(-1, y.shape[-1]), layernorm, eps), lead)) if want_stats else y
    y, stats, _ = torch.ops.coda.dropout_residual.default(x, residual, float(p), want_stats, layernorm, float(eps))
    return (y, _to_user(stats, lead)) if want_stats else y
