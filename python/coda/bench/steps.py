"""What the cases share: random inputs, and a function turned into the step that is timed."""

from __future__ import annotations

from typing import Callable, Sequence

import torch


def rand(*shape: int, dtype: torch.dtype, device: str, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def residual_stream(m: int, d: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """(m, d) rows whose means drift up to 10 standard deviations: a norm's input as a
    residual stream gives it, where a one-pass variance would cancel."""
    return ((torch.rand(m, 1, device=device) * 2 - 1) * 10 + torch.randn(m, d, device=device)).to(dtype)


def norm_params(d: int, dtype: torch.dtype, device: str):
    """A norm's (weight, bias) away from their (1, 0) initialization, so that a fold that drops one shows."""
    return (1 + 0.2 * torch.randn(d, device=device)).to(dtype), (0.2 * torch.randn(d, device=device)).to(dtype)


def forward(fn: Callable, args: Sequence) -> Callable[[], object]:
    """fn(*args) for inference: no autograd state kept."""
    def step():
        with torch.no_grad():
            return fn(*args)
    return step


def forward_backward(fn: Callable, args: Sequence, grads) -> Callable[[], object]:
    """fn(*args) and the gradients of its outputs (given `grads`) w.r.t. every arg that
    requires grad, through autograd.grad: nothing accumulates from one step to the next."""
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]

    def step():
        return torch.autograd.grad(fn(*args), leaves, grads)
    return step


def trainable(tensors: Sequence) -> list:
    """Copies of the tensors that require grad (None stays None)."""
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]


def compiled(fn: Callable) -> Callable:
    """torch.compile of fn for one case's shapes; one per case. Dynamo caches compiled
    code per Python function, so a case's shapes would otherwise add to the entries the
    earlier cases left, up to its recompile limit, and a second shape would be compiled
    for dynamic sizes. The first call compiles, outside any timed region."""
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)
