"""Numerics of folding a norm into the next GEMM, emulated on the CPU.

Groundwork for the norm-GEMM ops (LayerNorm/RMSNorm folded into the GEMM
that reads them): which operand carries γ decides whether the fold meets the
error bar when rows have |mean| ≫ std, as residual streams do.

    LayerNorm(x)·Wᵀ + b = rstd ⊙ (x̃·W̃ᵀ − μ·s) + t

Two ways to place γ, both with the subtraction done on fp32 accumulators:
  A. x̃ = bf16(x ⊙ γ) as the GEMM's A operand (written by the previous GEMM's
     epilogue), W̃ = W, s = γ·Wᵀ. Rounding x ⊙ γ costs |x|·2⁻⁹ per element,
     which the subtraction of μ·s then exposes at the scale of x − μ: with
     |μ| = 10σ the error is ~10x the unfused path's.
  B. x̃ = x (already bf16, exact), W̃ = bf16(W ∘ γ) once per step, and
     s = rowsum(W̃) from the *rounded* W̃, so μ·s cancels exactly what the
     GEMM multiplied. The only new rounding is W̃'s, relative 2⁻⁹ like the
     unfused path's rounding of x̂. The cancellation happens in fp32 where
     it costs ~2⁻²⁴·|μ|/σ.
These tests hold B to the unfused bf16 path's error and record that A is not.
Measured here (512 x 1024 -> 768, bf16, seed 1), ‖out − ref‖/‖ref‖:
    row means within   unfused   B (γ on W)   A (γ on x)
    0σ                 2.32e-3   2.30e-3      2.30e-3
    10σ                2.33e-3   2.30e-3      9.60e-3
    30σ                2.33e-3   2.30e-3      2.74e-2
"""

import pytest
import torch
import torch.nn.functional as F

from helpers import rel_err

EPS = 1e-5


def rows_with_offsets(m, k, offset_sigmas, dtype=torch.bfloat16):
    """Rows of std 1 whose means are spread uniformly in ±offset_sigmas."""
    mean = (torch.rand(m, 1, dtype=torch.float64) * 2 - 1) * offset_sigmas
    return (mean + torch.randn(m, k, dtype=torch.float64)).to(dtype)


def params(k, n, dtype=torch.bfloat16):
    gamma = (1 + 0.2 * torch.randn(k, dtype=torch.float64)).to(dtype)
    beta = (0.2 * torch.randn(k, dtype=torch.float64)).to(dtype)
    w = (torch.randn(n, k, dtype=torch.float64) / k**0.5).to(dtype)
    b = (0.2 * torch.randn(n, dtype=torch.float64)).to(dtype)
    return gamma, beta, w, b


def stats(x):
    x = x.double()
    mu = x.mean(-1, keepdim=True)
    var = x.var(-1, unbiased=False, keepdim=True)
    return mu.float(), torch.rsqrt(var + EPS).float()  # fp32, as a finalize step would keep them


def folded(x, gamma, beta, w, b, gamma_on_weight: bool):
    """The fold as an epilogue would compute it: bf16 operands, fp32 accumulate and epilogue."""
    mu, rstd = stats(x)
    if gamma_on_weight:  # B
        a_op, w_op = x, (w.float() * gamma.float()).to(x.dtype)
        s = w_op.float().sum(-1)
    else:  # A
        a_op, w_op = (x.float() * gamma.float()).to(x.dtype), w
        s = (w.float() * gamma.float()).sum(-1)
    t = w.float() @ beta.float() + b.float()
    acc = a_op.float() @ w_op.float().t()
    return (rstd * (acc - mu * s) + t).to(x.dtype)


def unfused(x, gamma, beta, w, b):
    return F.linear(F.layer_norm(x, (x.shape[-1],), gamma, beta, EPS), w, b)


def reference(x, gamma, beta, w, b):
    return unfused(*(t.double() for t in (x, gamma, beta, w, b)))


@pytest.mark.parametrize("offset_sigmas", [0.0, 1.0, 10.0])
def test_gamma_on_weight_meets_the_unfused_error(offset_sigmas, seed):
    x = rows_with_offsets(512, 1024, offset_sigmas)
    p = params(1024, 768)
    ref = reference(x, *p)
    err_b = rel_err(folded(x, *p, gamma_on_weight=True), ref)
    err_torch = rel_err(unfused(x, *p), ref)
    assert err_b <= 1.25 * err_torch, (seed, err_b, err_torch)


def test_gamma_on_activation_loses_to_cancellation(seed):
    x = rows_with_offsets(512, 1024, 10.0)
    p = params(1024, 768)
    ref = reference(x, *p)
    err_a = rel_err(folded(x, *p, gamma_on_weight=False), ref)
    err_torch = rel_err(unfused(x, *p), ref)
    assert err_a > 3 * err_torch, (seed, err_a, err_torch)


def test_rmsnorm_fold_needs_no_mean():
    # RMSNorm(x)·Wᵀ = rstd ⊙ (x·(W∘γ)ᵀ): nothing is subtracted, so no cancellation.
    x = rows_with_offsets(512, 1024, 10.0)
    gamma, _, w, _ = params(1024, 768)
    rstd = torch.rsqrt(x.double().square().mean(-1, keepdim=True) + EPS).float()
    w_g = (w.float() * gamma.float()).to(x.dtype)
    out = (rstd * (x.float() @ w_g.float().t())).to(x.dtype)
    ref = F.linear(F.rms_norm(x.double(), (1024,), gamma.double(), EPS), w.double())
    unfused_rms = F.linear(F.rms_norm(x, (1024,), gamma, EPS), w)
    assert rel_err(out, ref) <= 1.25 * rel_err(unfused_rms, ref)
