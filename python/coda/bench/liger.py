"""Liger-Kernel's norms and the LLaMA block's ops as plain functions, imported on first
use: liger and triton are optional, and `import coda.bench` loads neither."""

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


def llama() -> Tuple[Optional[Tuple[Callable, Callable, Callable]], str]:
    """The LLaMA block's Liger-Kernel ops, (rms_norm(x, weight, eps), silu_mul(gate, up),
    rope(q, k, cos, sin)) with rope as liger_rotary_pos_emb takes them (q, k (batch, heads,
    seq, head_dim), cos and sin (1, seq, head_dim)), or (None, why not). Needs a CUDA GPU."""
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception as e:  # not installed, or no triton
        return None, f"liger_kernel is not importable ({why(e)})"
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb as rope
    except Exception:  # liger_kernel.transformers wants transformers; its rope is this Function
        from liger_kernel.ops.rope import LigerRopeFunction

        def rope(q, k, cos, sin):
            return LigerRopeFunction.apply(q, k, cos, sin)
    return (lambda x, w, eps: LigerRMSNormFunction.apply(x, w, eps), LigerSiLUMulFunction.apply, rope), ""
