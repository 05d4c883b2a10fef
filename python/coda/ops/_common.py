"""What the fused ops share: flattening to rows, autocast, and the guard
that makes double backward a clear error."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor


def rows(t: Tensor) -> Tensor:
    """(..., F) -> (rows, F); explicit, so F = 0 is not ambiguous."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def autocast(x: Tensor, *tensors: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
    """x and the tensors cast to the autocast dtype where autocast is on for
    x's device (as nn.Linear's inputs and weights are), else as they are.
    The casts are differentiable, so fp32 parameters get fp32 gradients."""
    if not torch._C._is_any_autocast_enabled():  # one call where autocast is off, the common case
        return (x, *tensors)
    if x.device.type not in ("cuda", "cpu") or not torch.is_autocast_enabled(x.device.type):
        return (x, *tensors)
    dt = torch.get_autocast_dtype(x.device.type)
    return tuple(t if t is None or t.dtype == dt else t.to(dt) for t in (x, *tensors))


def needs_grad(*tensors: Optional[Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def first_order(op: str, grads: tuple) -> tuple:
    """The gradients a backward returns, made to fail with a message naming
    `op` if they are differentiated again (create_graph=True): the kernels'
    backward is not itself differentiable."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return grads
    present = [g for g in grads if isinstance(g, Tensor)]
    if not present:
        return grads
    fail = torch._C._functions.DelayedError(f"coda.{op}: double backward is not supported".encode(), len(present))
    marked = iter(fail(*[g.detach().requires_grad_() for g in present]))
    return tuple(next(marked) if isinstance(g, Tensor) else g for g in grads)
