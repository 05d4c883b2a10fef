"""Activation names, their kernel codes, and their float reference formulas."""

from __future__ import annotations

import math
from typing import Optional

import torch

# Codes match coda::Activation / coda::epilogues::ActivationKind.
IDENTITY, GELU_TANH, GELU_ERF, RELU, SILU = 0, 1, 2, 3, 4

_CODES = {
    None: IDENTITY,
    "identity": IDENTITY,
    "none": IDENTITY,
    "gelu_tanh": GELU_TANH,
    "gelu_new": GELU_TANH,  # Hugging Face's name for the tanh form (GPT-2)
    "gelu_pytorch_tanh": GELU_TANH,
    "gelu": GELU_ERF,  # nn.GELU() / F.gelu default: the exact erf form
    "gelu_erf": GELU_ERF,
    "relu": RELU,
    "silu": SILU,
    "swish": SILU,
}

NAMES = {IDENTITY: "identity", GELU_TANH: "gelu_tanh", GELU_ERF: "gelu_erf", RELU: "relu", SILU: "silu"}


def code(activation: Optional[str]) -> int:
    """The kernel code of an activation name (None means identity)."""
    key = activation.lower() if isinstance(activation, str) else activation
    if key not in _CODES:
        names = sorted(k for k in _CODES if k is not None)
        raise ValueError(f"coda: activation must be None or one of {names}, got {activation!r}")
    return _CODES[key]


def apply(h: torch.Tensor, act: int) -> torch.Tensor:
    """act(h), as torch computes it (the reference path)."""
    if act == IDENTITY:
        return h
    if act == GELU_TANH:
        return torch.nn.functional.gelu(h, approximate="tanh")
    if act == GELU_ERF:
        return torch.nn.functional.gelu(h)
    if act == RELU:
        return torch.relu(h)
    if act == SILU:
        return torch.nn.functional.silu(h)
    raise ValueError(f"coda: unknown activation code {act}")


def grad(h: torch.Tensor, act: int) -> torch.Tensor:
    """d act(h) / dh, computed in h's dtype (pass float32 or float64)."""
    if act == IDENTITY:
        return torch.ones_like(h)
    if act == GELU_TANH:
        k0, k1 = math.sqrt(2.0 / math.pi), 0.044715
        t = torch.tanh(k0 * (h + k1 * h**3))
        return 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * k0 * (1 + 3 * k1 * h * h)
    if act == GELU_ERF:
        return 0.5 * (1 + torch.erf(h / math.sqrt(2.0))) + h * torch.exp(-0.5 * h * h) / math.sqrt(2 * math.pi)
    if act == RELU:
        return (h > 0).to(h.dtype)
    if act == SILU:
        s = torch.sigmoid(h)
        return s * (1 + h * (1 - s))
    raise ValueError(f"coda: unknown activation code {act}")
