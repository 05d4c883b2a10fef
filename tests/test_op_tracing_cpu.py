"""The op layer on the CPU: the C++ ops get CPU stand-ins (plain torch math)
for the test's duration, so what is checked is the ops' C++ autograd (which
gradients each backward is asked for, what it saves, x as its own residual,
the double-backward error), their fakes and what dynamo accepts, not the
kernels (tests/test_gpu*.py check those against float64)."""

import pytest
import torch
import torch.nn.functional as F
from helpers import cpu_stand_in

from coda import _activations, _kernels
from coda.ops import layernorm_linear, linear, linear_residual, mlp, norm_mlp, rmsnorm_linear
from coda.ops.linear import linear_reference, mlp_reference
from coda.ops.norm import norm_linear_reference, norm_mlp_reference

pytestmark = pytest.mark.skipif(not _kernels.available(), reason="coda._C is not built: no coda ops to stand in for")

EPS = 1e-5  # the norms' eps in these tests: the stand-in backwards, like the kernels', are not given it


def _none(like):
    return like.new_empty(0)


def _rows(t):
    return t.reshape(-1, t.shape[-1])


def _linear(x, weight, bias, residual, activation, save):
    h = F.linear(x, weight, bias)
    y = _activations.apply(h, activation)
    if residual is not None:
        y = y + residual
    return y, (_rows(h).clone() if save and activation else _none(x))


def _act_grad(dy, h, activation):
    # The stand-ins run below autograd, as the kernels do: derivatives by formula.
    return dy * _activations.grad(h, activation)


def _linear_backward(dy, x, weight, pre_act, activation, needs):
    dy2, x2 = _rows(dy), _rows(x)
    dh = dy2 if activation == 0 else _act_grad(dy2, pre_act, activation)
    return ((dh @ weight).view(x.shape) if needs[0] else _none(x), dh.t() @ x2 if needs[1] else _none(x),
            dh.sum(0) if needs[2] else _none(x))


def _mlp(x, w1, b1, w2, b2, residual, activation, save):
    h = F.linear(x, w1, b1)
    a = _activations.apply(h, activation)
    y = F.linear(a, w2, b2)
    return ((y if residual is None else y + residual), _rows(h).clone() if save and activation else _none(x),
            _rows(a).clone() if save else _none(x))


def _mlp_backward(dy, x, w1, w2, h1, a1, activation, needs):
    dy2, x2 = _rows(dy), _rows(x)
    dh = _act_grad(dy2 @ w2, h1, activation) if activation else dy2 @ w2
    return ((dh @ w1).view(x.shape), dh.t() @ x2, dh.sum(0), dy2.t() @ a1, dy2.sum(0))


def _stats(x, layernorm):
    xf = _rows(x).float()
    var, mean = torch.var_mean(xf, -1, correction=0) if layernorm else (xf.square().mean(-1), xf.new_zeros(len(xf)))
    return torch.stack([mean, torch.rsqrt(var + EPS)])


def _norm(x, g, b, layernorm):
    return F.layer_norm(x, x.shape[-1:], g, b, EPS) if layernorm else F.rms_norm(x, x.shape[-1:], g, EPS)


def _fold(w, g, b, bias, layernorm, folded):
    if folded is not None:
        return _none(w).float(), _none(w).float()
    s = (w * g).float().sum(-1) if layernorm else _none(w).float()
    t = (w.float() @ b.float() if b is not None else w.new_zeros(w.shape[0]).float())
    return s, (t + bias.float() if bias is not None else t)


def _norm_linear(x, g, b, w, bias, stats, folded, col_sum, shift, layernorm, eps, activation, save):
    y, h = _linear(_norm(x, g, b, layernorm), w, bias, None, activation, save)
    return (y, h, _stats(x, layernorm) if stats is None else _none(x).float(), *_fold(w, g, b, bias, layernorm, folded))


def _norm_backward(dp, x, g, b, w, layernorm, needs):
    """dx, dγ, dβ, dW of Norm(x)·Wᵀ given dP (rows), by the textbook formulas."""
    x2 = _rows(x)
    mean, rstd = _stats(x, layernorm)
    xhat = (x2 - mean[:, None]) * rstd[:, None]
    n = xhat * g + (b if b is not None else 0)
    dn = dp @ w
    dxhat = dn * g
    proj = (dxhat * xhat).mean(-1, keepdim=True)
    dx = rstd[:, None] * (dxhat - (dxhat.mean(-1, keepdim=True) if layernorm else 0) - xhat * proj)
    return (dx.view(x.shape), (dn * xhat).sum(0), dn.sum(0) if b is not None else _none(x), dp.t() @ n)


def _norm_linear_backward(dy, x, g, b, w, pre, stats, col_sum, shift, layernorm, activation, needs):
    dp = _rows(dy) if activation == 0 else _act_grad(_rows(dy), _rows(pre), activation)
    dx, dg, db, dw = _norm_backward(dp, x, g, b, w, layernorm, needs)
    return dx, dg, db, dw, dp.sum(0)


def _norm_mlp(x, g, b, w1, b1, w2, b2, stats, folded, col_sum, shift, residual, add_input, layernorm, eps,
              activation, save, want_stats):
    y, h1, a1 = _mlp(_norm(x, g, b, layernorm), w1, b1, w2, b2, x if add_input else residual, activation, save)
    return (y, h1, a1, _stats(x, layernorm) if stats is None else _none(x).float(),
            *_fold(w1, g, b, b1, layernorm, folded), _stats(y, layernorm) if want_stats else _none(x).float())


def _norm_mlp_backward(dy, x, g, b, w1, w2, h1, a1, stats, col_sum, shift, add_input, layernorm, activation, needs):
    dy2 = _rows(dy)
    dh = _act_grad(dy2 @ w2, h1, activation) if activation else dy2 @ w2
    dx, dg, db, dw1 = _norm_backward(dh, x, g, b, w1, layernorm, needs)
    if add_input:
        dx = dx + dy
    return dx, dg, db, dw1, dh.sum(0), dy2.t() @ a1, dy2.sum(0)


def _linear_residual(x, weight, bias, residual, layernorm, eps):
    y = F.linear(x, weight, bias) + residual
    return y, _stats(y, layernorm)


STAND_INS = {"linear": _linear, "linear_backward": _linear_backward, "mlp": _mlp, "mlp_backward": _mlp_backward,
             "norm_linear": _norm_linear, "norm_linear_backward": _norm_linear_backward, "norm_mlp": _norm_mlp,
             "norm_mlp_backward": _norm_mlp_backward, "linear_residual": _linear_residual}


@pytest.fixture
def cpu_ops(monkeypatch):
    yield from cpu_stand_in(monkeypatch, STAND_INS)


def _params(d=32, f=64, n=48):
    torch.manual_seed(0)
    r = torch.randn
    return dict(x=r(2, 8, d), g=1 + 0.2 * r(d), b=0.2 * r(d), w=r(n, d) / 6, bias=r(n) / 4, w1=r(f, d) / 6,
                b1=r(f) / 4, w2=r(d, f) / 8, b2=r(d) / 4, wo=r(d, d) / 6, bo=r(d) / 4)


def _cases(p):
    """name -> (coda op, reference, inputs); the op and the reference take the inputs in the same order."""
    return {
        "linear": (lambda x, w, b: linear(x, w, b, "gelu_tanh"),
                   lambda x, w, b: linear_reference(x, w, b, "gelu_tanh"), [p["x"], p["w"], p["bias"]]),
        "linear_identity": (lambda x, w: linear(x, w), lambda x, w: linear_reference(x, w), [p["x"], p["w"]]),
        "mlp": (lambda x, w1, b1, w2, b2, r: mlp(x, w1, b1, w2, b2, "silu", r),
                lambda x, w1, b1, w2, b2, r: mlp_reference(x, w1, b1, w2, b2, "silu", r),
                [p["x"], p["w1"], p["b1"], p["w2"], p["b2"], p["x"] * 0.5]),
        "mlp_residual_is_x": (lambda x, w1, w2: mlp(x, w1, None, w2, None, "gelu_tanh", x),
                              lambda x, w1, w2: mlp_reference(x, w1, None, w2, None, "gelu_tanh", x),
                              [p["x"], p["w1"], p["w2"]]),
        "layernorm_linear": (lambda x, g, b, w, bias: layernorm_linear(x, g, b, w, bias, EPS, "relu"),
                             lambda x, g, b, w, bias: norm_linear_reference(x, g, b, w, bias, "LayerNorm", EPS, "relu"),
                             [p["x"], p["g"], p["b"], p["w"], p["bias"]]),
        "rmsnorm_linear": (lambda x, g, w: rmsnorm_linear(x, g, w, None, EPS),
                           lambda x, g, w: norm_linear_reference(x, g, None, w, None, "RMSNorm", EPS),
                           [p["x"], p["g"], p["w"]]),
        "norm_mlp": (lambda x, g, b, w1, b1, w2, b2, r: norm_mlp(x, g, b, w1, b1, w2, b2, "LayerNorm", EPS, "gelu", r),
                     lambda x, g, b, w1, b1, w2, b2, r: norm_mlp_reference(x, g, b, w1, b1, w2, b2, "LayerNorm", EPS,
                                                                           "gelu", r),
                     [p["x"], p["g"], p["b"], p["w1"], p["b1"], p["w2"], p["b2"], p["x"] * 0.5]),
        "norm_mlp_residual_is_x": (lambda x, g, w1, w2: norm_mlp(x, g, None, w1, None, w2, None, "RMSNorm", EPS,
                                                                 "gelu_tanh", x),
                                   lambda x, g, w1, w2: norm_mlp_reference(x, g, None, w1, None, w2, None, "RMSNorm",
                                                                           EPS, "gelu_tanh", x),
                                   [p["x"], p["g"], p["w1"], p["w2"]]),
        "linear_residual": (lambda x, w, b, r: linear_residual(x, w, b, r)[0],
                            lambda x, w, b, r: F.linear(x, w, b) + r, [p["x"], p["wo"], p["bo"], p["x"] * 0.5]),
        "linear_residual_is_x": (lambda x, w: linear_residual(x, w, None, x, "RMSNorm", EPS)[0],
                                 lambda x, w: F.linear(x, w) + x, [p["x"], p["wo"]]),
    }


def _grads(fn, inputs, wanted, dy_seed=1):
    leaves = [t.detach().clone().requires_grad_(w) for t, w in zip(inputs, wanted)]
    y = fn(*leaves)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(dy_seed))
    want = [t for t in leaves if t.requires_grad]
    got = iter(torch.autograd.grad(y, want, dy)) if want else iter(())
    return y.detach(), [next(got) if t.requires_grad else None for t in leaves]


@pytest.mark.parametrize("case", list(_cases(_params())))
@pytest.mark.parametrize("which", ["all", "first", "rest", "none"])
def test_cpp_autograd_gradients(cpu_ops, case, which):
    # Each gradient the C++ Function returns goes to the right input, for any
    # subset of inputs that require grad (the Function's edges skip absent
    # optional tensors).
    fn, ref, inputs = _cases(_params())[case]
    wanted = {"all": [True] * len(inputs), "first": [True] + [False] * (len(inputs) - 1),
              "rest": [False] + [True] * (len(inputs) - 1), "none": [False] * len(inputs)}[which]
    if which == "none":
        with torch.no_grad():
            y, y_ref = fn(*inputs), ref(*inputs)
        torch.testing.assert_close(y, y_ref)
        return
    y, grads = _grads(fn, inputs, wanted)
    y_ref, grads_ref = _grads(ref, inputs, wanted)
    torch.testing.assert_close(y, y_ref)
    for i, (g, g_ref) in enumerate(zip(grads, grads_ref)):
        assert (g is None) == (g_ref is None), f"input {i}"
        if g is not None:
            torch.testing.assert_close(g, g_ref, msg=lambda m: f"{case}: grad of input {i}: {m}")


@pytest.mark.parametrize("case,op", [("linear", "linear"), ("mlp", "mlp"), ("layernorm_linear", "norm_linear"),
                                     ("norm_mlp", "norm_mlp"), ("linear_residual", "linear_residual")])
def test_double_backward_names_the_op(cpu_ops, case, op):
    fn, _, inputs = _cases(_params())[case]
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    g = torch.autograd.grad(fn(*leaves).square().sum(), leaves[0], create_graph=True)[0]
    with pytest.raises(RuntimeError, match=f"coda.{op}: double backward is not supported"):
        g.sum().backward()


def test_no_graph_without_grad(cpu_ops):
    p = _params()
    x = p["x"].requires_grad_()
    with torch.no_grad():
        y = layernorm_linear(x, p["g"], p["b"], p["w"], p["bias"])
    assert y.grad_fn is None and not y.requires_grad
    y = linear_residual(x, p["wo"], None, x)[1]
    assert not y.requires_grad  # the statistics carry no gradient


@pytest.mark.parametrize("case", ["mlp_residual_is_x", "linear_residual_is_x", "norm_mlp", "layernorm_linear"])
def test_compiles_fullgraph(cpu_ops, case):
    # The C++ Autograd kernels traced by AOTAutograd through the ops' fakes;
    # x as its own residual put one tensor twice into one Python
    # autograd.Function, which dynamo refused (torch 2.14) or got x.grad wrong (2.11).
    fn, _, inputs = _cases(_params())[case]
    wanted = [True] * len(inputs)
    y, grads = _grads(fn, inputs, wanted)
    torch._dynamo.reset()
    try:
        y_c, grads_c = _grads(torch.compile(fn, fullgraph=True, backend="aot_eager"), inputs, wanted)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(y_c, y)
    for g_c, g in zip(grads_c, grads):
        torch.testing.assert_close(g_c, g)
