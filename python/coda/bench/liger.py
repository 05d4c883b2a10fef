"""Liger-Kernel's norms as plain functions, imported on first use: liger and triton
are optional, and `import coda.bench` loads neither."""

from __future__ import annotations

from typing import Callable, Optional, Tuple

from .timing import why


def norm(normalization: str, gpu: bool) -> Tuple[Optional[Callable], str]:
    """(fn, "") or (None, why not). LayerNorm: fn(x, weight, bias, eps); RMSNorm: fn(x, weight, eps)."""
    if not gpu:
        return None, "Liger-Kernel's Triton kernels need a CUDA GPU"
    try:
        from liger_kernel.ops import LigerLayerNormFunction, LigerRMSNormFunction
    except Exception as e:  # not installed, or no triton
        return None, f"liger_kernel is not importable ({why(e)})"
    if normalization == "LayerNorm":
        return (lambda x, w, b, eps: LigerLayerNormFunction.apply(x, w, b, eps)), ""
    return (lambda x, w, eps: LigerRMSNormFunction.apply(x, w, eps)), ""
