"""The compiled kernels (torch.ops.coda.*): loading, when a call may use
them, the visible fallback, and the introspection tests and benchmarks use.

A call runs the kernels when its tensors are on an sm_90 CUDA device, in a
dtype with kernels, with feature sizes that are multiples of 8; strides and
alignment never send a call elsewhere (the C++ side copies a tensor it cannot
read in place). Anything else runs the reference path, which gives the same
answer more slowly: silently for CPU tensors, which have no kernels by
design, and with a one-time warning (an error under strict mode, set by
CODA_STRICT=1 or coda.set_strict) for CUDA tensors.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Dict, Optional, Sequence

import torch

try:
    from . import _C  # noqa: F401  (registers torch.ops.coda.*)

    LOAD_ERROR: Optional[str] = None
except ImportError as e:  # built without the extension, or a broken build
    LOAD_ERROR = str(e)

BF16_FP16 = (torch.bfloat16, torch.float16)
BF16 = (torch.bfloat16,)


class FallbackWarning(UserWarning):
    """A coda op ran its reference path instead of its kernels."""


_strict = os.environ.get("CODA_STRICT", "") not in ("", "0")
_warned = set()


def available() -> bool:
    """True when the extension loaded (it may still find no usable GPU)."""
    return LOAD_ERROR is None


_sm90_of: Dict[int, bool] = {}


def _sm90(index: int) -> bool:
    if index not in _sm90_of:
        _sm90_of[index] = bool(torch.ops.coda.device_supported(index))
    return _sm90_of[index]


# Under torch.compile the answer is taken at trace time, as a constant (what
# torch._dynamo.assume_constant_result marks; set here without importing dynamo).
_sm90._dynamo_marked_constant = True


def device_ok(device: torch.device) -> bool:
    """True when coda's kernels run on this CUDA device (sm_90)."""
    if device.type != "cuda" or not available():
        return False
    return _sm90(device.index if device.index is not None else torch.cuda.current_device())


def set_strict(enabled: bool = True) -> None:
    """Strict mode: a fallback to the reference path on a CUDA device raises
    instead of warning (also CODA_STRICT=1)."""
    global _strict
    _strict = bool(enabled)


def why_not(x: torch.Tensor, dtypes: Sequence[torch.dtype], sizes: Sequence[int]) -> Optional[str]:
    """None if a call whose tensors are like x and whose feature sizes are
    `sizes` runs the kernels, else the reason it does not. The other tensors'
    dtype and device were checked to match x's."""
    if x.device.type != "cuda":
        return "cpu"
    if not available():
        return f"the extension did not load ({LOAD_ERROR})"
    if x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        return f"dtype {str(x.dtype).replace('torch.', '')} has no kernel ({names} have)"
    for s in sizes:
        if s <= 0 or s % 8:
            return f"feature sizes {list(sizes)} are not all positive multiples of 8"
    if not device_ok(x.device):
        return f"device {x.device} ({torch.cuda.get_device_name(x.device)}) is not sm_90"
    return None


_reference_only = False


@contextlib.contextmanager
def reference_only():
    """Every op inside the block runs its reference path, silently: for benchmarks that time
    the unfused torch code inside a patched model (a decode step on the kernels or not)."""
    global _reference_only
    before, _reference_only = _reference_only, True
    try:
        yield
    finally:
        _reference_only = before


def use_kernels(op: str, x: torch.Tensor, dtypes: Sequence[torch.dtype], sizes: Sequence[int],
                unsupported: Optional[str] = None) -> bool:
    """Whether `op` runs its kernels on these inputs; says why not, once per
    op and reason, where a CUDA call falls back. No rows: nothing to compute.
    unsupported: what of the call the op's kernels cannot take (a head size, ...), or None."""
    if _reference_only:
        return False
    reason = why_not(x, dtypes, sizes) or unsupported
    if reason is None:
        return x.numel() > 0
    if reason != "cpu":
        fallback(op, reason)
    return False


def fallback(op: str, reason: str) -> None:
    message = f"coda.{op} ran its reference path: {reason}"
    if _strict:
        raise RuntimeError(message + " (strict mode: CODA_STRICT / coda.set_strict)")
    if torch.compiler.is_compiling():
        return  # the warning was given, or will be, by the eager call; no graph break for it
    if (op, reason) not in _warned:
        _warned.add((op, reason))
        warnings.warn(message, FallbackWarning, stacklevel=4)


# ---- introspection, for tests and benchmarks (not the API)

@contextlib.contextmanager
def override_kernel(config: int = -1, raster: int = -1, swizzle: int = -1):
    """Every GEMM in the block takes this configuration (where its program is
    built in it), raster order (1 along M, 2 along N) and swizzle; -1 leaves a
    choice to the library's rule."""
    torch.ops.coda._set_kernel_override(config, raster, swizzle)
    try:
        yield
    finally:
        torch.ops.coda._set_kernel_override(-1, -1, -1)


@contextlib.contextmanager
def cross_entropy_one_read():
    """In the block, linear_cross_entropy(recompute=False)'s cross-entropy pass runs the one-read kernel (a
    cluster of CTAs holds each row of logits in shared memory; rows up to 8 x 100 KB) where it fits; the
    default kernel elsewhere and after. Yields a function giving the one-read kernel's launches since entry."""
    first = torch.ops.coda._cross_entropy_one_read_launches()
    torch.ops.coda._set_cross_entropy_one_read(True)
    try:
        yield lambda: torch.ops.coda._cross_entropy_one_read_launches() - first
    finally:
        torch.ops.coda._set_cross_entropy_one_read(False)


@contextlib.contextmanager
def lm_head_grad_epilogue():
    """In the block, linear_cross_entropy's recomputing backward (recompute=True, and "half"'s second half)
    forms d loss / d logits in the epilogue of the GEMM that recomputes each slice of logits (the
    linear_ce_grad program) instead of writing the logits for the cross-entropy kernel; a slice whose width is
    no multiple of 8 (the last of an odd vocabulary) runs as before. Off by default until measured. Yields a
    function giving the slices it ran since entry."""
    first = torch.ops.coda._lm_head_grad_epilogue_slices()
    torch.ops.coda._set_lm_head_grad_epilogue(True)
    try:
        yield lambda: torch.ops.coda._lm_head_grad_epilogue_slices() - first
    finally:
        torch.ops.coda._set_lm_head_grad_epilogue(False)


def kernels_built() -> Dict[str, Dict[int, str]]:
    """program -> {configuration value: name} of every kernel built."""
    out: Dict[str, Dict[int, str]] = {}
    for entry in torch.ops.coda._kernels_built():
        program, name, _dtype, value = entry.split("/")
        out.setdefault(program, {})[int(value)] = name
    return out


def programs() -> Dict[str, str]:
    """program name -> its pass ("forward", "dgrad", "wgrad"), as csrc/kernels/table.def declares them."""
    return dict(entry.split("/") for entry in torch.ops.coda._programs())


def kernel_configs(program: str) -> Dict[int, str]:
    """The configurations a program ("linear_act", "dact_dbias", ...) is built in."""
    return kernels_built().get(program, {})


def kernel_choice(program: str, m: int, n: int, k: int, dtype: str = "bf16", sms: int = 132) -> Dict[str, object]:
    """What the rule (csrc/choice.cpp) picks for an (m, n, k) GEMM of `program`, launching
    nothing: {"config": name, "raster", "swizzle", "vendor": whether a plain GEMM of it
    goes to cuBLAS on `sms` SMs}."""
    config, raster, swizzle, vendor = torch.ops.coda._kernel_choice(program, dtype, m, n, k, sms)
    return {"config": config, "raster": raster, "swizzle": swizzle, "vendor": vendor}


def launch_counts() -> Dict[str, int]:
    """Kernel launches so far, keyed "program/config_name"."""
    keys, counts = torch.ops.coda._launch_counts()
    return dict(zip(keys, counts))


@contextlib.contextmanager
def recording_launches():
    """Records every GEMM launch inside the block: yields a list that fills, on the block's exit,
    with one dict per launch, oldest first: {"program", "config", "dtype", "m", "n", "k",
    "a", "lda", "a_layout", "b", "ldb", "b_layout", "raster", "swizzle"}, A (m x k) and
    B (k x n) as the kernel read them: their addresses, leading dimensions and layouts
    ("row" or "col"). D = epilogue(A·B) is (m x n)."""
    records: list = []
    torch.ops.coda._record_launches(True)
    try:
        yield records
    finally:
        keys, ints = torch.ops.coda._take_launches()
        torch.ops.coda._record_launches(False)
        for i, key in enumerate(keys):
            program, config, dtype, a_layout, b_layout = key.split("/")
            m, n, k, a, lda, b, ldb, raster, swizzle = ints[9 * i:9 * i + 9]
            records.append(dict(program=program, config=config, dtype=dtype, m=m, n=n, k=k, a=a, lda=lda,
                                a_layout=a_layout, b=b, ldb=ldb, b_layout=b_layout, raster=raster, swizzle=swizzle))


FACTS = ("stages", "epilogue_bytes", "epilogue_tile_m", "epilogue_tile_n", "stages_c", "stages_d", "smem_bytes")


def kernel_facts() -> Dict[str, Dict[str, int]]:
    """"program/config_name/dtype" -> what each built kernel's types come to: its mainloop stages, the
    epilogue's shared memory (bytes, subtile rows x columns, load and store stages) and the kernel's in all."""
    keys, ints = torch.ops.coda._kernel_facts()
    n = len(FACTS)
    return {key: dict(zip(FACTS, ints[n * i:n * i + n])) for i, key in enumerate(keys)}
