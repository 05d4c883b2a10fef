"""What the fused ops share: flattening to rows, and autocast. (Their
autograd, the double-backward guard included, is C++: csrc/torch/autograd.h.)"""

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
