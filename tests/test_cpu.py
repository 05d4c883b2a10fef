"""Tests that run anywhere: the reference path, shapes, errors, op registration,
autograd and tracing. CI runs these on a machine without a GPU."""

import os

import pytest
import torch
import torch.nn.functional as F

import coda
from coda import reference
from helpers import rel_err

ACTIVATIONS = [None, "gelu_tanh", "gelu", "relu", "silu"]


def make_linear(m, k, n, dtype=torch.float32, bias=True, requires_grad=False):
    x = torch.randn(m, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype) / k**0.5
    b = torch.randn(n, dtype=dtype) if bias else None
    for t in (x, w, b):
        if t is not None:
            t.requires_grad_(requires_grad)
    return x, w, b


def make_mlp(m, d, f, e=None, dtype=torch.float32, requires_grad=False, residual=True):
    e = d if e is None else e
    ts = [torch.randn(m, d, dtype=dtype), torch.randn(f, d, dtype=dtype) / d**0.5, torch.randn(f, dtype=dtype),
          torch.randn(e, f, dtype=dtype) / f**0.5, torch.randn(e, dtype=dtype),
          torch.randn(m, e, dtype=dtype) if residual else None]
    for t in ts:
        if t is not None:
            t.requires_grad_(requires_grad)
    return ts


def test_extension_built_when_required():
    # CI sets this: a build that produced no loadable extension must fail there.
    if os.environ.get("CODA_REQUIRE_EXTENSION") != "1":
        pytest.skip("CODA_REQUIRE_EXTENSION is not set")
    assert coda.kernels_available(), coda._kernels.LOAD_ERROR


def test_kernel_configs_listed():
    # What a tuning sweep may ask for: "value:name" pairs, the fallback first;
    # a pip build holds the shipped configurations only.
    if not coda.kernels_available():
        pytest.skip("the extension is not built here")
    for op in ("linear", "norm_linear", "dgrad", "wgrad", "linear_residual", "norm_dgrad"):
        pairs = [item.split(":") for item in torch.ops.coda.kernel_configs(op).split(",")]
        assert pairs[0] == ["0", "cooperative_128x256_2x1"], op
        assert all(v.isdigit() and name for v, name in pairs), op
    assert [v for v, _ in (i.split(":") for i in torch.ops.coda.kernel_configs("linear").split(","))][:2] == ["0", "1"]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_reference(activation, bias, seed):
    x, w, b = make_linear(13, 24, 40, bias=bias)
    out = coda.ops.linear(x, w, b, activation)
    ref = reference.linear_ref(x.double(), w.double(), None if b is None else b.double(), activation)
    assert rel_err(out, ref) < 1e-5, seed


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_mlp_matches_reference(activation, seed):
    x, w1, b1, w2, b2, r = make_mlp(11, 16, 48)
    out = coda.ops.mlp(x, w1, b1, w2, b2, activation=activation, residual=r)
    ref = reference.mlp_ref(*(t.double() for t in (x, w1, b1, w2, b2)), activation=activation, residual=r.double())
    assert rel_err(out, ref) < 1e-5, seed


def test_leading_batch_dims():
    x = torch.randn(2, 3, 5, 16)
    w, b = torch.randn(24, 16), torch.randn(24)
    assert coda.ops.linear(x, w, b, "gelu_tanh").shape == (2, 3, 5, 24)
    w1, w2 = torch.randn(32, 16), torch.randn(16, 32)
    r = torch.randn(2, 3, 5, 16)
    y = coda.ops.mlp(x, w1, None, w2, None, residual=r)
    assert y.shape == (2, 3, 5, 16)
    torch.testing.assert_close(y, reference.mlp_ref(x, w1, None, w2, None, residual=r))


def test_one_dimensional_input_like_nn_linear():
    x, w, b = torch.randn(16), torch.randn(8, 16), torch.randn(8)
    torch.testing.assert_close(coda.ops.linear(x, w, b), F.linear(x, w, b))


def test_kernel_size_rule():
    # Zero or unaligned feature sizes go to the reference path, never to a kernel.
    assert coda._kernels.sizes_ok([8, 1024, 3000])
    assert not coda._kernels.sizes_ok([0, 1024])
    assert not coda._kernels.sizes_ok([1030, 1024])


def test_zero_in_features():
    x, w, b = torch.randn(4, 0), torch.randn(8, 0), torch.randn(8)
    torch.testing.assert_close(coda.ops.linear(x, w, b, "relu"), torch.relu(b).expand(4, 8))


def test_zero_tokens():
    x = torch.randn(0, 16, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    y = coda.ops.linear(x, w, None, "relu")
    assert y.shape == (0, 8)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_gradcheck(activation, bias):
    x, w, b = make_linear(5, 8, 6, dtype=torch.float64, bias=bias, requires_grad=True)
    inputs = (x, w) if b is None else (x, w, b)
    fn = (lambda x, w: coda.ops.linear(x, w, None, activation)) if b is None else \
        (lambda x, w, b: coda.ops.linear(x, w, b, activation))
    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_mlp_gradcheck(activation):
    ts = make_mlp(4, 6, 10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, w1, b1, w2, b2, r: coda.ops.mlp(x, w1, b1, w2, b2, activation=activation, residual=r), ts)


def test_mlp_gradcheck_no_bias_no_residual():
    x, w1, _, w2, _, _ = make_mlp(4, 6, 10, dtype=torch.float64, requires_grad=True, residual=False)
    assert torch.autograd.gradcheck(lambda x, w1, w2: coda.ops.mlp(x, w1, None, w2, None, "silu"), (x, w1, w2))


def test_frozen_weights_get_no_grad():
    x, w1, b1, w2, b2, r = make_mlp(4, 8, 16)
    x.requires_grad_(True)
    coda.ops.mlp(x, w1, b1, w2, b2, residual=r).sum().backward()
    assert x.grad is not None and w1.grad is None and w2.grad is None


def test_state_outputs_are_not_differentiable():
    # Pre-activations and the like are state for the backward: were they
    # differentiable, autograd would hand the backward zero tensors of their size.
    x, w1, b1, w2, b2, r = make_mlp(4, 6, 10, requires_grad=True)
    y, h1, a1 = torch.ops.coda.mlp(x, w1, b1, w2, b2, r, 1, True)
    assert y.requires_grad and not h1.requires_grad and not a1.requires_grad
    y, h = torch.ops.coda.linear(x, w1, b1, 1, True)
    assert y.requires_grad and not h.requires_grad
    y, mean, rstd = torch.ops.coda.linear_residual(x, w1[:6], b1[:6], x, True, 1e-5)
    assert y.requires_grad and not mean.requires_grad and not rstd.requires_grad


def test_opcheck_ops():
    x, w, b = make_linear(6, 8, 16, requires_grad=True)
    torch.library.opcheck(torch.ops.coda.linear.default, (x, w, b, 1, True))
    torch.library.opcheck(torch.ops.coda.linear.default, (x, w, None, 0, True))
    # inference: nothing saved, nothing to differentiate
    torch.library.opcheck(torch.ops.coda.linear.default, (x.detach(), w.detach(), None, 2, False))
    ts = make_mlp(6, 8, 16, requires_grad=True)
    torch.library.opcheck(torch.ops.coda.mlp.default, (*ts, 1, True))
    torch.library.opcheck(torch.ops.coda.mlp.default, (*ts[:5], None, 0, True))
    torch.library.opcheck(torch.ops.coda.mlp.default, (*(t.detach() for t in ts[:5]), None, 3, False))
    dy = torch.randn(6, 8)
    x, w1, _, w2, _, _ = (t.detach() for t in ts)
    h1, a1 = torch.randn(6, 16), torch.randn(6, 16)
    torch.library.opcheck(torch.ops.coda.mlp_backward.default,
                          (dy, x, w1, w2, h1, a1, 1, True, True, True, True, True))
    torch.library.opcheck(torch.ops.coda.linear_backward.default,
                          (torch.randn(6, 16), x, torch.randn(16, 8), h1, 4, True, True, True))


def test_compile_fullgraph_mlp():
    torch._dynamo.reset()
    ts = make_mlp(8, 16, 32, requires_grad=True)

    def block(x, w1, b1, w2, b2, r):
        return coda.ops.mlp(x, w1, b1, w2, b2, activation="gelu_tanh", residual=r)

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    y = compiled(*ts)
    y.square().sum().backward()
    grads = [t.grad.clone() for t in ts]
    for t in ts:
        t.grad = None
    block(*ts).square().sum().backward()
    for g, t in zip(grads, ts):
        torch.testing.assert_close(g, t.grad)


# ---- errors name the argument and what was expected

def test_error_weight_shape():
    with pytest.raises(ValueError, match=r"weight must have shape \(out_features, 16\)"):
        coda.ops.linear(torch.randn(4, 16), torch.randn(8, 15))


def test_error_bias_shape():
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        coda.ops.linear(torch.randn(4, 16), torch.randn(8, 16), torch.randn(9))


def test_error_dtype_mismatch():
    with pytest.raises(TypeError, match="weight has dtype torch.float64, expected torch.float32"):
        coda.ops.linear(torch.randn(4, 16), torch.randn(8, 16, dtype=torch.float64))


def test_error_device_mismatch():
    with pytest.raises(ValueError, match="w2 is on meta, expected cpu"):
        coda.ops.mlp(torch.randn(4, 16), torch.randn(32, 16), None, torch.randn(16, 32, device="meta"), None)


def test_error_activation():
    with pytest.raises(ValueError, match="activation must be None or one of"):
        coda.ops.linear(torch.randn(4, 16), torch.randn(8, 16), activation="tanh")
    with pytest.raises(ValueError, match="activation must be None or one of"):
        coda.nn.Linear(16, 8, activation="swiglu")


def test_error_residual_shape():
    with pytest.raises(ValueError, match=r"residual must have shape \(4, 16\)"):
        coda.ops.mlp(torch.randn(4, 16), torch.randn(32, 16), None, torch.randn(16, 32), None,
                     residual=torch.randn(4, 32))


def test_error_integer_input():
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        coda.ops.linear(torch.ones(4, 16, dtype=torch.int32), torch.randn(8, 16))


# ---- modules hold parameters that load plain PyTorch weights

def test_linear_module_is_a_drop_in():
    plain = torch.nn.Linear(16, 24)
    ours = coda.nn.Linear(16, 24, activation="gelu_tanh")
    assert isinstance(ours, torch.nn.Linear)
    assert ours.state_dict().keys() == plain.state_dict().keys()
    ours.load_state_dict(plain.state_dict())
    x = torch.randn(3, 16)
    torch.testing.assert_close(ours(x), F.gelu(plain(x), approximate="tanh"))
    no_bias = coda.nn.Linear(16, 24, bias=False)
    assert no_bias.bias is None and set(no_bias.state_dict()) == {"weight"}


def test_mlp_module_loads_two_linears():
    fc1, fc2 = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)
    sd = {f"fc1.{k}": v for k, v in fc1.state_dict().items()}
    sd.update({f"fc2.{k}": v for k, v in fc2.state_dict().items()})
    m = coda.nn.MLP(16, 64, activation="gelu")
    m.load_state_dict(sd)
    x, r = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    torch.testing.assert_close(m(x, residual=r), fc2(F.gelu(fc1(x))) + r)


def test_mlp_module_trains_on_cpu():
    torch.manual_seed(0)
    m = coda.nn.MLP(8, 32, activation="silu")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, target = torch.randn(64, 8), torch.randn(64, 8)
    first = None
    for _ in range(20):
        loss = F.mse_loss(m(x), target)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first
