"""The GELU MLP's cases (`--only mlp`): linear + bias + GELU forward, the MLP forward, and
the MLP forward + backward, each against its GEMMs alone in cuBLAS, eager PyTorch and
torch.compile (and cuBLASLt's bias + GELU epilogue where it applies)."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

import coda

from . import steps
from .timing import Runner


def _linear_gelu(x, w, b):
    return F.gelu(F.linear(x, w, b), approximate="tanh")


def eager_mlp(x, w1, b1, w2, b2):
    return F.linear(_linear_gelu(x, w1, b1), w2, b2)


def coda_mlp(x, w1, b1, w2, b2):
    return coda.ops.mlp(x, w1, b1, w2, b2, activation="gelu_tanh")


def inputs(m: int, d: int, f: int, dtype: torch.dtype, device: str) -> list:
    """x, w1, b1, w2, b2."""
    torch.manual_seed(0)
    return [steps.rand(m, d, dtype=dtype, device=device), steps.rand(f, d, dtype=dtype, device=device, scale=d**-0.5),
            steps.rand(f, dtype=dtype, device=device), steps.rand(d, f, dtype=dtype, device=device, scale=f**-0.5),
            steps.rand(d, dtype=dtype, device=device)]


def cublas_fwd_bwd(x, w1, w2, dy):
    """The MLP's six GEMMs alone, forward and backward."""
    x, w1, w2 = x.detach(), w1.detach(), w2.detach()

    def step():
        a = torch.matmul(x, w1.t())
        torch.matmul(a, w2.t())
        torch.matmul(dy.t(), a)
        da = torch.matmul(dy, w2)
        torch.matmul(da.t(), x)
        torch.matmul(da, w1)
    return step


def run(r: Runner, m: int, dims: Sequence[int], dtype: torch.dtype, device: str) -> None:
    for d in dims:
        f = 4 * d
        x, w1, b1, w2, b2 = inputs(m, d, f, dtype, device)

        fl = 2.0 * m * d * f
        args = (x, w1, b1)
        r.interleaved(f"linear_bias_gelu_fwd_{m}x{d}x{f}", {
            "coda": steps.forward(lambda *a: coda.ops.linear(*a, "gelu_tanh"), args),
            "cublas": lambda: torch.matmul(x, w1.t()),
            "eager": steps.forward(_linear_gelu, args),
            "cublaslt": steps.forward(lambda x, w, b: torch._addmm_activation(b, x, w.t(), use_gelu=True), args),
            "compile": steps.forward(steps.compiled(_linear_gelu), args),
        }, fl, reference="eager")

        args = (x, w1, b1, w2, b2)
        r.interleaved(f"mlp_fwd_{m}x{d}x{f}", {
            "coda": steps.forward(coda_mlp, args),
            "cublas": lambda: torch.matmul(torch.matmul(x, w1.t()), w2.t()),
            "eager": steps.forward(eager_mlp, args),
            "compile": steps.forward(steps.compiled(eager_mlp), args),
        }, 2 * fl, reference="eager")

        params = steps.trainable(args)
        dy = steps.rand(m, d, dtype=dtype, device=device)
        r.interleaved(f"mlp_fwd_bwd_{m}x{d}x{f}", {
            "coda": steps.forward_backward(coda_mlp, params, dy),
            "cublas": cublas_fwd_bwd(x, w1, w2, dy),
            "eager": steps.forward_backward(eager_mlp, params, dy),
            "compile": steps.forward_backward(steps.compiled(eager_mlp), params, dy),
        }, 6 * fl, reference="eager")
