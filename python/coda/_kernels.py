"""The compiled kernels (torch.ops.coda.gemm_*): loading, fake kernels, and
when a call may use them.

Kernel-ready means: CUDA tensors on an sm_90 device, all bf16 or all fp16,
rows contiguous, 16-byte aligned, inner sizes multiples of 8. Anything else
takes the reference path, which gives the same answer more slowly.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

try:
    from . import _C  # noqa: F401  (registers torch.ops.coda.*)

    LOAD_ERROR: Optional[str] = None
except ImportError as e:  # built without the extension, or a broken build
    LOAD_ERROR = str(e)

KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def available() -> bool:
    """True when the extension loaded (it may still find no usable GPU)."""
    return LOAD_ERROR is None


@functools.lru_cache(maxsize=None)
def _device_ok(index: int) -> bool:
    return available() and bool(torch.ops.coda.device_supported(index))


def device_ok(device: torch.device) -> bool:
    """True when coda's kernels run on this CUDA device (sm_90)."""
    if device.type != "cuda" or not available():
        return False
    return _device_ok(device.index if device.index is not None else torch.cuda.current_device())


def why_not(tensors: Sequence[Optional[torch.Tensor]], inner_sizes: Sequence[int]) -> Optional[str]:
    """None if these tensors are kernel-ready, else the reason they are not."""
    present = [t for t in tensors if t is not None]
    first = present[0]
    if not available():
        return f"the extension did not load ({LOAD_ERROR})"
    if first.device.type != "cuda":
        return "tensors are not on a CUDA device"
    if first.dtype not in KERNEL_DTYPES:
        return f"dtype {first.dtype} has no kernel (bfloat16, float16 have)"
    for t in present:
        if t.dtype != first.dtype or t.device != first.device:
            return "tensors differ in dtype or device"
        if t.numel() and t.data_ptr() % 16:
            return "a tensor is not 16-byte aligned"
    if not sizes_ok(inner_sizes):
        return f"feature sizes {list(inner_sizes)} are not all positive multiples of 8"
    if not device_ok(first.device):
        return f"device {first.device} is not sm_90"
    return None


def sizes_ok(inner_sizes: Sequence[int]) -> bool:
    """TMA moves 16-byte rows: every feature size a positive multiple of 8 elements."""
    return all(s > 0 and s % 8 == 0 for s in inner_sizes)


def usable(tensors: Sequence[Optional[torch.Tensor]], inner_sizes: Sequence[int]) -> bool:
    return why_not(tensors, inner_sizes) is None


def norm_usable(tensors: Sequence[Optional[torch.Tensor]], inner_sizes: Sequence[int]) -> bool:
    """Kernel-ready for the norm-folding kernels, which are built for bf16 only."""
    return tensors[0].dtype == torch.bfloat16 and usable(tensors, inner_sizes)


def rows(t: torch.Tensor) -> torch.Tensor:
    """t as a 2-D tensor with contiguous, 16-byte-aligned rows."""
    if t.dim() != 2:
        t = t.reshape(-1, t.shape[-1])
    if t.stride(-1) != 1 or t.stride(0) % 8 or t.data_ptr() % 16:
        t = t.contiguous()
    return t


if available():

    @torch.library.register_fake("coda::gemm_linear")
    def _(x, weight, bias, residual, activation, save_pre_act):
        y = x.new_empty(x.shape[0], weight.shape[0])
        h = x.new_empty(x.shape[0], weight.shape[0]) if save_pre_act else x.new_empty(0)
        return y, h

    @torch.library.register_fake("coda::gemm_dgrad")
    def _(dy, weight, pre_act, activation, compute_dbias):
        dx = dy.new_empty(dy.shape[0], weight.shape[1])
        db = dy.new_empty(weight.shape[1]) if compute_dbias else dy.new_empty(0)
        return dx, db

    @torch.library.register_fake("coda::gemm_wgrad")
    def _(dy, x):
        return dy.new_empty(dy.shape[1], x.shape[1])

    def _f32(like, *shape):
        return like.new_empty(*shape, dtype=torch.float32)

    @torch.library.register_fake("coda::norm_fold_weight")
    def _(weight, gamma, beta, bias, want_folded):
        n = weight.shape[0]
        return (weight.new_empty(weight.shape) if want_folded else weight.new_empty(0)), _f32(weight, n), \
            _f32(weight, n)

    @torch.library.register_fake("coda::norm_row_stats")
    def _(x, layernorm, eps):
        return _f32(x, x.shape[0] if layernorm else 0), _f32(x, x.shape[0])

    @torch.library.register_fake("coda::gemm_norm_linear")
    def _(x, weight, mean, rstd, col_sum, shift, activation, save_pre_act):
        shape = (x.shape[0], weight.shape[0])
        return x.new_empty(shape), (x.new_empty(shape) if save_pre_act else x.new_empty(0))

    @torch.library.register_fake("coda::gemm_linear_residual")
    def _(x, weight, bias, residual, layernorm, eps):
        m = x.shape[0]
        return x.new_empty(m, weight.shape[0]), _f32(x, m if layernorm else 0), _f32(x, m)

    @torch.library.register_fake("coda::gemm_dgrad_rowdot")
    def _(dy, weight, pre_act, activation, compute_dbias, shift, col_sum, scale):
        m, n = dy.shape[0], weight.shape[1]
        with_c2 = col_sum is not None and col_sum.numel() > 0
        return dy.new_empty(m, n), (dy.new_empty(n) if compute_dbias else dy.new_empty(0)), _f32(dy, m), \
            _f32(dy, m if with_c2 else 0)

    @torch.library.register_fake("coda::norm_row_dots")
    def _(dy, pre_act, activation, shift, col_sum, scale, compute_dbias):
        m, n = dy.shape
        with_c2 = col_sum is not None and col_sum.numel() > 0
        return (dy.new_empty(dy.shape) if activation != 0 else dy.new_empty(0)), _f32(dy, m), \
            _f32(dy, m if with_c2 else 0), dy.new_empty(n if compute_dbias else 0)

    @torch.library.register_fake("coda::gemm_norm_dgrad")
    def _(dp, weight, x, mean, rstd, gamma, beta, c1, c2, residual_grad, want_normalized, want_dgamma):
        n = weight.shape[1]
        e = dp.new_empty
        return e(x.shape), (e(x.shape) if want_normalized else e(0)), (e(n) if want_dgamma else e(0)), \
            (e(n) if want_dgamma and beta is not None else e(0))
