"""coda.ops.rmsnorm_residual (Gemma's sandwich norms: residual + RMSNorm(x)·γ) where no GPU is: the
reference path is Hugging Face's Gemma RMSNorm and add; the backward's formulas (the kernel's:
dx = rstd·(g − x̂·mean(g ⊙ x̂)), g = dY ⊙ γ, dγ = Σ dY ⊙ x̂, the residual's gradient dY) through the
C++ op's autograd with CPU stand-ins; its fakes under torch.compile(fullgraph=True); bad arguments."""

import pytest
import torch

from helpers import cpu_stand_in

from coda import ops


def _inputs(m=6, d=32, dtype=torch.float64):
    torch.manual_seed(0)
    return (torch.randn(3, m, d, dtype=dtype), (0.2 * torch.randn(d)).to(dtype), torch.randn(3, m, d, dtype=dtype))


def test_reference_is_gemmas_norm_and_add():
    transformers = pytest.importorskip("transformers")
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    x, w, r = _inputs(dtype=torch.float32)
    norm = Gemma3RMSNorm(x.shape[-1], eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(w)
    assert transformers is not None
    assert torch.equal(ops.rmsnorm_residual(x, norm.weight, r, 1e-6, zero_centered=True), r + norm(x))
    plain = r + x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(ops.rmsnorm_residual(x, w, r, 1e-6), plain)


def test_bad_arguments_name_what_was_expected():
    x, w, r = _inputs()
    with pytest.raises(ValueError, match=r"weight must have shape \(32,\)"):
        ops.rmsnorm_residual(x, w[:3], r, 1e-6)
    with pytest.raises(ValueError, match=r"residual must have shape \(3, 6, 32\)"):
        ops.rmsnorm_residual(x, w, r[:, :2], 1e-6)
    with pytest.raises(ValueError, match="weight must be given"):
        ops.rmsnorm_residual(x, None, r, 1e-6)


def _forward(x, weight, residual, eps, zero_centered):
    rstd = torch.rsqrt(x.pow(2).mean(-1) + eps).reshape(-1)  # the kernel's is fp32; float64 here, as the reference
    return ops.rmsnorm_residual_reference(x, weight, residual, eps, zero_centered), rstd


def _backward(dy, x, weight, rstd, zero_centered, needs):
    d = x.shape[-1]
    x2, dy2 = x.reshape(-1, d), dy.reshape(-1, d)
    xhat = x2 * rstd[:, None].to(x.dtype)
    gamma = weight + 1 if zero_centered else weight
    g = dy2 * gamma
    dx = rstd[:, None].to(x.dtype) * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    return (dx.view(x.shape) if needs[0] else x.new_empty(0)), ((dy2 * xhat).sum(0) if needs[1] else x.new_empty(0))


@pytest.fixture
def cpu_ops(monkeypatch):
    yield from cpu_stand_in(monkeypatch, {"rmsnorm_residual": _forward, "rmsnorm_residual_backward": _backward})


@pytest.mark.parametrize("zero_centered", [False, True])
def test_op_gradients_are_the_references(cpu_ops, zero_centered):
    x, w, r = _inputs()
    dy = torch.randn_like(x)
    got = []
    for fn in (ops.rmsnorm_residual, ops.rmsnorm_residual_reference):
        xl, wl, rl = (t.clone().requires_grad_(True) for t in (x, w, r))
        y = fn(xl, wl, rl, 1e-6, zero_centered)
        y.backward(dy)
        got.append((y.detach(), xl.grad, wl.grad, rl.grad))
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_op_traces_whole_under_compile(cpu_ops):
    x, w, r = _inputs(dtype=torch.float32)
    dy = torch.randn_like(x)
    results = []
    for compile_it in (True, False):
        xl, wl, rl = (t.clone().requires_grad_(True) for t in (x, w, r))
        fn = lambda x, w, r: ops.rmsnorm_residual(x, w, r, 1e-6, True)  # noqa: E731
        torch._dynamo.reset()
        try:
            y = (torch.compile(fn, fullgraph=True, backend="aot_eager") if compile_it else fn)(xl, wl, rl)
            y.backward(dy)
        finally:
            torch._dynamo.reset()
        results.append((y.detach(), xl.grad, wl.grad, rl.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)
