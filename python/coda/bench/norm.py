"""The norm-folding ops' cases (`--only norm`): LayerNorm -> QKV + bias, RMSNorm -> QKV of
grouped-query models (N = 3d/2), o-proj + residual + the next norm's row statistics, and
the pre-norm MLP x + MLP(LayerNorm(x)), forward and forward + backward."""

from __future__ import annotations

from functools import partial
from typing import Sequence

import torch
import torch.nn.functional as F

import coda

from . import liger, steps
from .timing import Runner


def _ln_qkv(x, g, b, w, bias):
    return F.linear(F.layer_norm(x, x.shape[-1:], g, b, 1e-5), w, bias)


def _rms_qkv(x, g, w):
    return F.linear(F.rms_norm(x, x.shape[-1:], g, 1e-6), w)


def _coda_ln_qkv(x, g, b, w, bias, stats=None):
    return coda.ops.layernorm_linear(x, g, b, w, bias, 1e-5, stats=stats)


def _coda_rms_qkv(x, g, w, stats=None):
    return coda.ops.rmsnorm_linear(x, g, w, eps=1e-6, stats=stats)


def _liger_rms_qkv(rms_norm, x, g, w):
    return F.linear(rms_norm(x, g, 1e-6), w)


def _residual_stats(a, w, bias, res):
    y = F.linear(a, w, bias) + res
    var, mean = torch.var_mean(y.float(), -1, correction=0)
    return y, torch.stack([mean, torch.rsqrt(var + 1e-5)], -1)


def _ln_mlp(x, g, b, w1, b1, w2, b2):
    h = F.linear(F.layer_norm(x, x.shape[-1:], g, b, 1e-5), w1, b1)
    return F.linear(F.gelu(h, approximate="tanh"), w2, b2) + x


def _coda_ln_mlp(x, g, b, w1, b1, w2, b2):
    return coda.ops.norm_mlp(x, g, b, w1, b1, w2, b2, "LayerNorm", 1e-5, "gelu_tanh", residual=x)


def run(r: Runner, m: int, dims: Sequence[int], dtype: torch.dtype, device: str) -> None:
    rms_norm, why_not = liger.norm("RMSNorm", r.gpu)
    for d in dims:
        torch.manual_seed(0)

        def rand(*shape, scale=1.0):
            return steps.rand(*shape, dtype=dtype, device=device, scale=scale)

        x = steps.residual_stream(m, d, dtype, device)
        gamma, beta = steps.norm_params(d, dtype, device)
        for name, n, layernorm in (("layernorm_qkv_bias", 3 * d, True), ("rmsnorm_qkv", 3 * d // 2, False)):
            w = rand(n, d, scale=d**-0.5)
            if layernorm:
                args, eager, fused = [x, gamma, beta, w, rand(n)], _ln_qkv, _coda_ln_qkv
            else:
                args, eager, fused = [x, gamma, w], _rms_qkv, _coda_rms_qkv
            stats = coda.ops.row_stats(x, "LayerNorm" if layernorm else "RMSNorm", 1e-5 if layernorm else 1e-6)
            fl = 2.0 * m * d * n
            # in a block the statistics come from the residual-reduce before (coda[stats]: no pass over x)
            impls = {"coda": steps.forward(fused, args),
                     "coda[stats]": steps.forward(partial(fused, stats=stats), args),
                     "cublas": lambda: torch.matmul(x, w.t()), "eager": steps.forward(eager, args),
                     "compile": steps.forward(steps.compiled(eager), args)}
            liger_fn = None
            if not layernorm and rms_norm is not None:
                liger_fn = partial(_liger_rms_qkv, rms_norm)
                impls["liger"] = steps.forward(liger_fn, args)
            elif not layernorm:
                r.skip(f"{name}_fwd_{m}x{d}x{n}", "liger", why_not)
            r.interleaved(f"{name}_fwd_{m}x{d}x{n}", impls, fl, reference="eager")

            params = steps.trainable(args)
            dy = rand(m, n)

            def three_gemms():
                torch.matmul(x, w.t())
                torch.matmul(dy, w)
                torch.matmul(dy.t(), x)

            impls = {"coda": steps.forward_backward(fused, params, dy), "cublas": three_gemms,
                     "eager": steps.forward_backward(eager, params, dy),
                     "compile": steps.forward_backward(steps.compiled(eager), params, dy)}
            if liger_fn is not None:
                impls["liger"] = steps.forward_backward(liger_fn, params, dy)
            r.interleaved(f"{name}_fwd_bwd_{m}x{d}x{n}", impls, 3 * fl, reference="eager")

        a, w_o, b_o = rand(m, d), rand(d, d, scale=d**-0.5), rand(d)
        args, fl = [a, w_o, b_o, x], 2.0 * m * d * d
        r.interleaved(f"oproj_residual_stats_fwd_{m}x{d}x{d}", {
            "coda": steps.forward(coda.ops.linear_residual, args),
            "cublas": lambda: torch.matmul(a, w_o.t()),
            "eager": steps.forward(_residual_stats, args),
            "compile": steps.forward(steps.compiled(_residual_stats), args),
        }, fl, reference="eager")
        params, dy = steps.trainable(args), rand(m, d)

        def y_only(fn):
            return lambda *p: fn(*p)[0]

        r.interleaved(f"oproj_residual_stats_fwd_bwd_{m}x{d}x{d}", {
            "coda": steps.forward_backward(y_only(coda.ops.linear_residual), params, dy),
            "cublas": lambda: (torch.matmul(a, w_o.t()), torch.matmul(dy, w_o), torch.matmul(dy.t(), a)),
            "eager": steps.forward_backward(y_only(_residual_stats), params, dy),
            "compile": steps.forward_backward(y_only(steps.compiled(_residual_stats)), params, dy),
        }, 3 * fl, reference="eager")

        f = 4 * d
        args = [x, gamma, beta, rand(f, d, scale=d**-0.5), rand(f), rand(d, f, scale=f**-0.5), rand(d)]
        params, dy = steps.trainable(args), rand(m, d)
        w1, w2 = args[3], args[5]

        def six_gemms():
            h = torch.matmul(x, w1.t())
            torch.matmul(h, w2.t())
            torch.matmul(dy.t(), h)
            dh = torch.matmul(dy, w2)
            torch.matmul(dh.t(), x)
            torch.matmul(dh, w1)

        r.interleaved(f"layernorm_mlp_fwd_bwd_{m}x{d}x{f}", {
            "coda": steps.forward_backward(_coda_ln_mlp, params, dy),
            "cublas": six_gemms,
            "eager": steps.forward_backward(_ln_mlp, params, dy),
            "compile": steps.forward_backward(steps.compiled(_ln_mlp), params, dy),
        }, 12.0 * m * d * f, reference="eager")
