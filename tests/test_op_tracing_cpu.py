"""The Python op layer under torch.compile, on the CPU: the C++ ops get CPU
stand-ins (plain torch math) for the test's duration, so what is checked is
the autograd.Functions, their fakes and what dynamo accepts, not the kernels."""

import sys

import pytest
import torch
import torch.nn.functional as F

from coda import _activations, _kernels
from coda.ops import linear_residual, mlp

pytestmark = pytest.mark.skipif(not _kernels.available(), reason="coda._C is not built: no coda ops to stand in for")


def _mlp(x, w1, b1, w2, b2, residual, activation, save):
    h = F.linear(x, w1, b1)
    a = _activations.apply(h, activation)
    y = F.linear(a, w2, b2)
    m = x.numel() // x.shape[-1]
    return (y if residual is None else y + residual), h.reshape(m, -1).clone(), a.reshape(m, -1).clone()


def _mlp_backward(dy, x, w1, w2, h1, a1, activation, needs):
    with torch.enable_grad():
        h = h1.detach().requires_grad_()
        dh, = torch.autograd.grad(_activations.apply(h, activation), h, dy.reshape(-1, dy.shape[-1]) @ w2)
    dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    return (dh @ w1).view(x.shape), dh.t() @ x2, dh.sum(0), dy2.t() @ a1, dy2.sum(0)


def _linear_residual(x, weight, bias, residual, layernorm, eps):
    y = F.linear(x, weight, bias) + residual
    return y, torch.zeros(2, x.numel() // x.shape[-1])


def _linear_backward(dy, x, weight, pre_act, activation, needs):
    dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    return dy @ weight, dy2.t() @ x2, dy2.sum(0)


@pytest.fixture
def cpu_ops(monkeypatch):
    lib = torch.library.Library("coda", "IMPL")
    for name, fn in (("mlp", _mlp), ("mlp_backward", _mlp_backward), ("linear_residual", _linear_residual),
                     ("linear_backward", _linear_backward)):
        lib.impl(name, fn, "CPU")
    monkeypatch.setattr(_kernels, "use_kernels", lambda op, x, dtypes, sizes: True)
    yield
    lib._destroy()


@pytest.mark.parametrize("op", ["mlp", "linear_residual"])
def test_residual_is_input_compiles(cpu_ops, op):
    # x as its own residual (y = f(x) + x) put one tensor twice into one
    # autograd.Function: dynamo refuses that (torch 2.14) or got x.grad wrong (2.11).
    torch.manual_seed(0)
    w1 = (torch.randn(64, 32) / 6).requires_grad_()
    w2 = (torch.randn(32, 64) / 8).requires_grad_()
    w = (torch.randn(32, 32) / 6).requires_grad_()
    if op == "mlp":
        def f(x): return mlp(x, w1, None, w2, None, "gelu_tanh", residual=x)
    else:
        def f(x): return linear_residual(x, w, None, x, "RMSNorm", 1e-5)[0]
    x = torch.randn(2, 8, 32, requires_grad=True)
    torch._dynamo.reset()
    y = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    y.square().sum().backward()
    g, x.grad = x.grad, None
    y_eager = f(x)
    y_eager.square().sum().backward()
    assert torch.allclose(y, y_eager) and torch.allclose(g, x.grad)
    torch._dynamo.reset()
