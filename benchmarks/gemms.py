"""The GEMMs of a Transformer block one kernel at a time, as coda runs them and as cuBLAS
does, for the kernel-level scripts (sweep.py, breakdown.py, power_probe.py,
profile_kernel.py).

The one place outside coda that calls torch.ops.coda.* directly: each call is a
fused op's binding given the arguments under which it launches one GEMM (the
`needs` flags of a backward, given statistics and fold), so that a kernel is
timed alone. Where a binding changes, this file changes.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, Dict, Tuple

import torch

from coda import _kernels
from coda._activations import GELU_TANH

Step = Callable[[], object]
ops = torch.ops.coda


def inputs(m: int, d: int, f: int, dtype: torch.dtype = torch.bfloat16) -> SimpleNamespace:
    """Every operand the problems below read, at tokens m, model width d, ffn f."""
    torch.manual_seed(0)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda") * scale).to(dtype)

    t = SimpleNamespace(m=m, d=d, f=f)
    t.x, t.dy, t.res = r(m, d), r(m, d), r(m, d)
    t.w1, t.b1, t.a1, t.h1 = r(f, d, scale=d**-0.5), r(f), r(m, f), r(m, f)
    t.w2, t.b2 = r(d, f, scale=f**-0.5), r(d)
    t.w_o = r(d, d, scale=d**-0.5)
    t.w_qkv, t.b_qkv, t.dp, t.h_qkv = r(3 * d, d, scale=d**-0.5), r(3 * d), r(m, 3 * d), r(m, 3 * d)
    t.g, t.beta = (1 + 0.2 * torch.randn(d, device="cuda")).to(dtype), r(d, scale=0.2)
    t.stats = ops.row_stats(t.x, True, 1e-5)
    t.fold = ops.fold_norm_weight(t.w_qkv, t.g, t.beta, t.b_qkv, True)  # (W̃, s, t)
    # RMSNorm -> QKV of grouped-query models: N = 3d/2, no bias
    t.n_gqa = 3 * d // 2
    t.w_gqa = r(t.n_gqa, d, scale=d**-0.5)
    t.rms_stats = ops.row_stats(t.x, False, 1e-6)
    t.rms_fold = ops.fold_norm_weight(t.w_gqa, t.g, None, None, False)
    return t


# ---- one kernel each: (program, coda's launch)

def linear(x, w, b=None, res=None, act=0, save_h=False) -> Tuple[str, Step]:
    return "linear_act", lambda: ops.linear(x, w, b, res, act, save_h)


def dgrad(dy, w, x) -> Tuple[str, Step]:
    """dy·w: linear_backward asked for dx alone (x only gives the shapes)."""
    return "dact_dbias", lambda: ops.linear_backward(dy, x, w, None, 0, [True, False, False])


def wgrad(dy, x, w) -> Tuple[str, Step]:
    """dyᵀ·x: linear_backward asked for dweight alone."""
    return "wgrad_store", lambda: ops.linear_backward(dy, x, w, None, 0, [False, True, False])


def dgrad_dbias(t, act=GELU_TANH) -> Tuple[str, Step]:
    """fc2's dgrad with act'(H) and db1 in its epilogue: mlp_backward asked for db1 alone."""
    return "dact_dbias", lambda: ops.mlp_backward(t.dy, t.x, t.w1, t.w2, t.h1, t.a1, act,
                                                  [False, False, True, False, False])


def norm_linear(t, rms=False) -> Tuple[str, Step]:
    """The folded norm's forward GEMM, its statistics and fold given."""
    if rms:
        folded, _, shift = t.rms_fold
        return "norm_linear_act", lambda: ops.norm_linear(t.x, t.g, None, t.w_gqa, None, t.rms_stats, folded, None,
                                                          shift, False, 1e-6, 0, False)
    folded, col_sum, shift = t.fold
    return "norm_linear_act", lambda: ops.norm_linear(t.x, t.g, t.beta, t.w_qkv, t.b_qkv, t.stats, folded, col_sum,
                                                      shift, True, 1e-5, 0, False)


def norm_backward(t, needs) -> Tuple[str, Step]:
    """LayerNorm -> QKV's backward: one pass for the row dots (and db), then, where any
    of dx, dγ, dβ is asked for, the dgrad GEMM with the norm's backward in its epilogue.
    needs: (dx, dγ, dβ, dW, db)."""
    _, col_sum, shift = t.fold
    return "norm_dgrad", lambda: ops.norm_linear_backward(t.dp, t.x, t.g, t.beta, t.w_qkv, t.h_qkv, t.stats, col_sum,
                                                          shift, True, 0, list(needs))


def linear_residual(t) -> Tuple[str, Step]:
    return "linear_residual_stats", lambda: ops.linear_residual(t.x, t.w_o, t.b2, t.res, True, 1e-5)


def sweep_problems(t) -> Dict[str, Tuple[float, str, Step, Step]]:
    """{name: (flops, program, coda, cuBLAS on the same GEMM)}: the MLP's, o-proj's and
    QKV's GEMMs, the configuration sweep's cases."""
    m, d, f, n = t.m, t.d, t.f, t.n_gqa
    fl, qkv, sq = 2.0 * m * d * f, 2.0 * m * d * 3 * d, 2.0 * m * d * d
    mm = torch.matmul
    cases = {
        f"fc1_fwd_save_h_{m}x{d}x{f}": (fl, linear(t.x, t.w1, t.b1, None, GELU_TANH, True), lambda: mm(t.x, t.w1.t())),
        f"fc1_fwd_{m}x{d}x{f}": (fl, linear(t.x, t.w1, t.b1, None, GELU_TANH), lambda: mm(t.x, t.w1.t())),
        f"fc2_fwd_residual_{m}x{f}x{d}": (fl, linear(t.a1, t.w2, t.b2, t.res), lambda: mm(t.a1, t.w2.t())),
        f"fc2_dgrad_dgelu_dbias_{m}x{d}x{f}": (fl, dgrad_dbias(t), lambda: mm(t.dy, t.w2)),
        f"fc2_dgrad_{m}x{d}x{f}": (fl, dgrad(t.dy, t.w2, t.a1), lambda: mm(t.dy, t.w2)),
        f"fc1_dgrad_{m}x{f}x{d}": (fl, dgrad(t.a1, t.w1, t.x), lambda: mm(t.a1, t.w1)),
        f"fc2_wgrad_{d}x{f}x{m}": (fl, wgrad(t.dy, t.a1, t.w2), lambda: mm(t.dy.t(), t.a1)),
        f"fc1_wgrad_{f}x{d}x{m}": (fl, wgrad(t.a1, t.x, t.w1), lambda: mm(t.a1.t(), t.x)),
        f"qkv_fwd_bias_{m}x{d}x{3 * d}": (qkv, linear(t.x, t.w_qkv, t.b_qkv), lambda: mm(t.x, t.w_qkv.t())),
        f"oproj_fwd_residual_{m}x{d}x{d}": (sq, linear(t.x, t.w_o, t.b2, t.res), lambda: mm(t.x, t.w_o.t())),
        f"oproj_dgrad_{m}x{d}x{d}": (sq, dgrad(t.dy, t.w_o, t.x), lambda: mm(t.dy, t.w_o)),
        f"oproj_residual_stats_{m}x{d}x{d}": (sq, linear_residual(t), lambda: mm(t.x, t.w_o.t())),
        f"rms_qkv_norm_linear_{m}x{d}x{n}": (2.0 * m * d * n, norm_linear(t, rms=True), lambda: mm(t.x, t.w_gqa.t())),
        f"rms_qkv_fwd_{m}x{d}x{n}": (2.0 * m * d * n, linear(t.x, t.w_gqa), lambda: mm(t.x, t.w_gqa.t())),
        f"qkv_wgrad_{3 * d}x{d}x{m}": (qkv, wgrad(t.dp, t.x, t.w_qkv), lambda: mm(t.dp.t(), t.x)),
        # the heaviest epilogue (two loads, two stores beside D), after its row-dot pass
        f"qkv_row_dots_norm_dgrad_{m}x{3 * d}x{d}": (qkv, norm_backward(t, (True, True, True, False, False)),
                                                     lambda: mm(t.dp, t.w_qkv)),
    }
    return {name: (flops, program, fn, cublas) for name, (flops, (program, fn), cublas) in cases.items()}


def breakdown_cases(t) -> Dict[str, Tuple[float, Step, Dict[str, Step]]]:
    """{name: (flops, cuBLAS, {impl: coda's kernel with one part of its epilogue or another})}:
    what each part of an epilogue costs on the same GEMM. Names without the shape."""
    m, d, f = t.m, t.d, t.f
    mm = torch.matmul

    def fn(problem):
        return problem[1]

    folded, col_sum, shift = t.fold
    return {
        "qkv_fwd": (2.0 * m * d * 3 * d, lambda: mm(t.x, t.w_qkv.t()), {
            "coda[linear+bias]": fn(linear(t.x, t.w_qkv, t.b_qkv)),
            "coda[norm_linear]": fn(norm_linear(t)),
            "coda[row_stats]": lambda: ops.row_stats(t.x, True, 1e-5),
            "coda[fold]": lambda: ops.fold_norm_weight(t.w_qkv, t.g, t.beta, t.b_qkv, True),
        }),
        "qkv_dgrad": (2.0 * m * d * 3 * d, lambda: mm(t.dp, t.w_qkv), {
            "coda[dgrad]": fn(dgrad(t.dp, t.w_qkv, t.x)),
            "coda[row_dots]": fn(norm_backward(t, (False,) * 5)),
            "coda[row_dots+dbias]": fn(norm_backward(t, (False,) * 4 + (True,))),
            "coda[row_dots+norm_dgrad]": fn(norm_backward(t, (True, True, True, False, False))),
            "coda[row_dots+norm_dgrad,no_dgamma]": fn(norm_backward(t, (True, False, False, False, False))),
            "coda[bias_grad]": lambda: t.dp.sum(0, dtype=torch.float32),
        }),
        "qkv_wgrad": (2.0 * m * d * 3 * d, lambda: mm(t.dp.t(), t.x), {"coda[wgrad]": fn(wgrad(t.dp, t.x, t.w_qkv))}),
        # RMSNorm -> QKV of grouped-query models (N = 3d/2): its own tile counts and waves
        "rms_qkv_fwd": (2.0 * m * d * t.n_gqa, lambda: mm(t.x, t.w_gqa.t()), {
            "coda[linear]": fn(linear(t.x, t.w_gqa)),
            "coda[norm_linear]": fn(norm_linear(t, rms=True)),
        }),
        "oproj_fwd": (2.0 * m * d * d, lambda: mm(t.x, t.w_o.t()), {
            "coda[linear+bias+residual]": fn(linear(t.x, t.w_o, t.b2, t.res)),
            "coda[linear_residual_stats]": fn(linear_residual(t)),
        }),
        # fc2's dgrad (cooperative): plain, with db1, with GELU'(H) and db1
        "fc2_dgrad": (2.0 * m * d * f, lambda: mm(t.dy, t.w2), {
            "coda[dgrad]": fn(dgrad(t.dy, t.w2, t.a1)),
            "coda[dbias]": fn(dgrad_dbias(t, act=0)),
            "coda[dgelu+dbias]": fn(dgrad_dbias(t)),
        }),
        # fc1's forward (ping-pong, which should hide its epilogue behind the other warp
        # group's mainloop), and the cooperative kernel (configuration 0)
        "fc1_fwd": (2.0 * m * d * f, lambda: mm(t.x, t.w1.t()), {
            "coda[plain]": fn(linear(t.x, t.w1)),
            "coda[bias]": fn(linear(t.x, t.w1, t.b1)),
            "coda[gelu]": fn(linear(t.x, t.w1, t.b1, None, GELU_TANH)),
            "coda[gelu,save_h]": fn(linear(t.x, t.w1, t.b1, None, GELU_TANH, True)),
            "coda[c0,plain]": overridden(fn(linear(t.x, t.w1)), config=0),
            "coda[c0,gelu,save_h]": overridden(fn(linear(t.x, t.w1, t.b1, None, GELU_TANH, True)), config=0),
        }),
    }


# ---- the library's override and counters (coda._kernels)

def overridden(fn: Step, config: int = -1, raster: int = -1, swizzle: int = -1) -> Step:
    """fn under a kernel override (-1 leaves that choice to the library's rule)."""
    def run():
        with _kernels.override_kernel(config=config, raster=raster, swizzle=swizzle):
            return fn()
    return run


def configs(program: str) -> Dict[int, str]:
    """The configurations `program` is built in, {value: name}."""
    return _kernels.kernel_configs(program)


def launched(fn: Step) -> Dict[str, int]:
    """The kernels one call of fn launches, {"program/config": count}: whether an
    override reached the kernel it was meant for (one not built in a program is
    ignored there)."""
    before = _kernels.launch_counts()
    fn()
    after = _kernels.launch_counts()
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}

