"""The norm-GEMM ops and modules on the reference path (CPU): values, gradients,
precomputed statistics, errors and state_dict loading. On an H200 the same
ops run the folded kernels (tests/test_gpu_norm.py)."""

import pytest
import torch
import torch.nn.functional as F

import coda
from helpers import check_op, rel_err


def ln_inputs(m=6, d=16, n=24, dtype=torch.float64, offset=0.0):
    x = torch.randn(m, d, dtype=dtype) + offset * torch.randn(m, 1, dtype=dtype)
    return x, 1 + 0.1 * torch.randn(d, dtype=dtype), 0.1 * torch.randn(d, dtype=dtype), \
        torch.randn(n, d, dtype=dtype) / d**0.5, torch.randn(n, dtype=dtype)


@pytest.mark.parametrize("activation", [None, "gelu_tanh", "silu"])
def test_layernorm_linear_matches_reference(activation, seed):
    x, g, b, w, bias = ln_inputs(offset=10.0)
    out = coda.ops.layernorm_linear(x, g, b, w, bias, activation=activation)
    ref = coda.reference.linear_ref(F.layer_norm(x, (16,), g, b, 1e-5), w, bias, activation)
    assert rel_err(out, ref) < 1e-12, seed


def test_rmsnorm_linear_matches_reference(seed):
    x, g, _, w, _ = ln_inputs()
    out = coda.ops.rmsnorm_linear(x, g, w, eps=1e-6, activation="relu")
    ref = torch.relu(F.linear(F.rms_norm(x, (16,), g, 1e-6), w))
    assert rel_err(out, ref) < 1e-12, seed


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_linear_residual_stats_feed_the_next_norm(normalization, seed):
    x, g, b, w, bias = ln_inputs(d=16, n=16)
    r = torch.randn(6, 16, dtype=torch.float64)
    y, stats = coda.ops.linear_residual(x, w, bias, r, normalization=normalization)
    assert rel_err(y, F.linear(x, w, bias) + r) < 1e-12
    assert stats.dtype == torch.float32 and stats.shape == (6, 2)
    w2 = torch.randn(8, 16, dtype=torch.float64)
    if normalization == "LayerNorm":
        with_stats = coda.ops.layernorm_linear(y, g, b, w2, stats=stats)
        without = coda.ops.layernorm_linear(y, g, b, w2)
        assert torch.allclose(stats[:, 0].double(), y.mean(-1), rtol=1e-5, atol=1e-6)
    else:
        with_stats = coda.ops.rmsnorm_linear(y, g, w2, eps=1e-5, stats=stats)
        without = coda.ops.rmsnorm_linear(y, g, w2, eps=1e-5)
        assert torch.equal(stats[:, 0], torch.zeros(6))
    assert rel_err(with_stats, without) < 1e-5, seed  # stats are fp32


@pytest.mark.parametrize("use_stats", [False, True])
def test_layernorm_linear_gradcheck(use_stats):
    x, g, b, w, bias = ln_inputs(m=4, d=8, n=6)
    stats = coda.ops.row_stats(x, "LayerNorm") if use_stats else None
    inputs = [t.requires_grad_(True) for t in (x, g, b, w, bias)]
    if use_stats:
        # stats in float32 change the value slightly: check the gradient in float64 without them,
        # and that with them it equals the gradient of a true LayerNorm at the same point
        y = coda.ops.layernorm_linear(*inputs[:4], inputs[4], stats=stats)
        ref = coda.reference.linear_ref(F.layer_norm(inputs[0], (8,), inputs[1], inputs[2]), inputs[3], inputs[4])
        dy = torch.randn_like(y)
        got = torch.autograd.grad(y, inputs, dy)
        want = torch.autograd.grad(ref, inputs, dy)
        for a, e in zip(got, want):
            assert rel_err(a, e) < 1e-5
    else:
        assert torch.autograd.gradcheck(
            lambda x, g, b, w, bias: coda.ops.layernorm_linear(x, g, b, w, bias, activation="gelu"), inputs)


def test_rmsnorm_linear_gradcheck():
    x, g, _, w, _ = ln_inputs(m=4, d=8, n=6)
    inputs = [t.requires_grad_(True) for t in (x, g, w)]
    assert torch.autograd.gradcheck(lambda x, g, w: coda.ops.rmsnorm_linear(x, g, w, activation="silu"), inputs)


def test_constant_rows_and_tiny_eps():
    # A constant row normalizes to 0: the output is β·Wᵀ + b, finite, for any eps.
    x = torch.full((3, 16), 7.0, dtype=torch.float64)
    _, g, b, w, bias = ln_inputs()
    for eps in (1e-5, 1e-12):
        out = coda.ops.layernorm_linear(x, g, b, w, bias, eps=eps)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, F.linear(b, w, bias).expand(3, -1))


def test_norm_errors():
    x, g, b, w, bias = ln_inputs(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"ln_weight must have shape \(16,\)"):
        coda.ops.layernorm_linear(x, g[:8], b, w)
    with pytest.raises(ValueError, match=r"stats must be a float32 tensor of shape \(6, 2\)"):
        coda.ops.layernorm_linear(x, g, b, w, stats=torch.zeros(6, 3))
    with pytest.raises(ValueError, match="normalization must be 'LayerNorm' or 'RMSNorm'"):
        coda.ops.linear_residual(x, w, None, torch.zeros(6, 24), normalization="batchnorm")
    with pytest.raises(ValueError, match=r"residual must have shape \(6, 24\)"):
        coda.ops.linear_residual(x, w, None, torch.zeros(6, 16))
    with pytest.raises(ValueError, match="normalization must be"):
        coda.nn.LayerNormLinear(16, 8, normalization="GroupNorm")


def test_modules_load_plain_pytorch_pairs():
    ln, lin = torch.nn.LayerNorm(16), torch.nn.Linear(16, 24)
    with torch.no_grad():
        ln.weight.normal_(), ln.bias.normal_()
    m = coda.nn.LayerNormLinear(16, 24, activation="gelu_tanh")
    m.norm.load_state_dict(ln.state_dict())
    m.linear.load_state_dict(lin.state_dict())
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(m(x), F.gelu(lin(ln(x)), approximate="tanh"))

    rms, lin2 = torch.nn.RMSNorm(16, eps=1e-6), torch.nn.Linear(16, 8, bias=False)
    r = coda.nn.RMSNormLinear(16, 8)
    r.load_state_dict({"norm.weight": rms.weight.detach(), "linear.weight": lin2.weight.detach()})
    torch.testing.assert_close(r(x), lin2(rms(x)))

    mlp = coda.nn.LayerNormMLP(16, 64, normalization="RMSNorm", activation="silu")
    assert set(mlp.state_dict()) == {"norm.weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    ref = mlp.fc2(F.silu(mlp.fc1(mlp.norm(x)))) + x
    torch.testing.assert_close(mlp(x, residual=x), ref)


def test_layernorm_mlp_compiles_fullgraph():
    torch._dynamo.reset()
    m = coda.nn.LayerNormMLP(16, 64)
    x = torch.randn(4, 16, requires_grad=True)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    compiled(x, residual=x).sum().backward()
    g = x.grad.clone()
    x.grad = None
    m(x, residual=x).sum().backward()
    torch.testing.assert_close(g, x.grad)


@pytest.mark.parametrize("normalization,residual", [("LayerNorm", "input"), ("RMSNorm", "other"), ("LayerNorm", None)])
def test_norm_mlp_gradcheck(normalization, residual):
    layernorm = normalization == "LayerNorm"
    x, g, b, w1, b1 = ln_inputs(m=4, d=8, n=12)
    w2, b2 = torch.randn(8, 12, dtype=torch.float64) / 12**0.5, torch.randn(8, dtype=torch.float64)
    r = torch.randn(4, 8, dtype=torch.float64) if residual == "other" else None
    inputs = [t.requires_grad_(True) for t in (x, g, b, w1, b1, w2, b2)] + ([r.requires_grad_(True)] if r is not None else [])

    def fn(x, g, b, w1, b1, w2, b2, *rest):
        res = x if residual == "input" else (rest[0] if rest else None)
        return coda.ops.norm_mlp(x, g, b if layernorm else None, w1, b1, w2, b2, normalization, 1e-5, "gelu_tanh",
                                 res)

    assert torch.autograd.gradcheck(fn, inputs)
    ref = coda.reference.norm_mlp_ref(x, g, b if layernorm else None, w1, b1, w2, b2, layernorm, 1e-5, "gelu_tanh",
                                      x if residual == "input" else r)
    assert rel_err(fn(*inputs), ref) < 1e-12


def test_linear_residual_gradcheck():
    x, _, _, w, bias = ln_inputs(m=4, d=8, n=8)
    r = torch.randn(4, 8, dtype=torch.float64)
    inputs = [t.requires_grad_(True) for t in (x, w, bias, r)]
    assert torch.autograd.gradcheck(lambda *a: coda.ops.linear_residual(*a)[0], inputs)


def test_fold_reference_cancels_with_the_rounded_weight():
    _, g, b, w, bias = ln_inputs(dtype=torch.bfloat16)
    folded, s, t = coda.reference.fold_norm_weight(w, g, b, bias)
    assert folded.dtype == torch.bfloat16 and s.dtype == torch.float32 and t.dtype == torch.float32
    assert torch.equal(s, folded.float().sum(-1))  # s from the rounded W̃, not from W∘γ
    torch.testing.assert_close(t, w.float() @ b.float() + bias.float())


def test_norm_mlp_errors():
    x, g, b, w1, b1 = ln_inputs(m=4, d=8, n=12)
    w2 = torch.randn(8, 12, dtype=torch.float64)
    with pytest.raises(ValueError, match="norm_bias must be None for RMSNorm"):
        coda.ops.norm_mlp(x, g, b, w1, b1, w2, None, "RMSNorm")
    with pytest.raises(ValueError, match=r"w2 must have shape \(out_features, 12\)"):
        coda.ops.norm_mlp(x, g, b, w1, b1, w2[:, :8], None)
    with pytest.raises(ValueError, match=r"residual must have shape \(4, 8\)"):
        coda.ops.norm_mlp(x, g, b, w1, b1, w2, None, residual=torch.zeros(4, 7, dtype=torch.float64))


@pytest.mark.parametrize("layernorm", [True, False])
def test_opcheck_norm_ops(layernorm):
    opcheck_norm_ops(layernorm, "cpu", torch.float32)


def opcheck_norm_ops(layernorm, device, dtype, m=6, d=16, n=24):
    """Schemas, fake kernels and autograd registration of every norm op,
    including the calls whose stats or fold come in as inputs (those outputs
    are then empty, and backward takes the inputs). On a GPU with bf16 and
    d, n multiples of 8 the ops run the folded kernels."""
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype)

    x, g, b, w, bias = randn(m, d), 1 + randn(d, scale=0.1), randn(d, scale=0.1), randn(n, d, scale=d**-0.5), randn(n)
    b = b if layernorm else None
    mean, rstd = coda.reference.row_stats(x, layernorm, 1e-5)
    mean = mean if layernorm else None
    folded = list(coda.reference.fold_norm_weight(w, g, b, bias))
    grads = [t.clone().requires_grad_(True) if t is not None else None for t in (x, g, b, w, bias)]
    for stats in ((None, None), (mean, rstd)):
        for fold in ([], folded):
            for args in (grads, [t.detach() if t is not None else None for t in grads]):
                check_op(torch.ops.coda.norm_linear.default, (*args, *stats, fold, layernorm, 1e-5, 1, True))
    w2 = randn(d, n, scale=n**-0.5)
    for stats, fold, residual, add_input in (((None, None), [], None, True), ((mean, rstd), folded, x, False)):
        check_op(torch.ops.coda.norm_mlp.default,
                 (*grads[:5], w2.clone().requires_grad_(True), None, *stats, fold, residual, add_input, layernorm,
                  1e-5, 1, True))
    dy, h = randn(m, n), randn(m, n)
    s, t = folded[1], folded[2]
    no_mean = mean if layernorm else rstd.new_empty(0)
    check_op(torch.ops.coda.norm_linear_backward.default,
             (dy, x, g, b, w, True, h, no_mean, rstd, s, t, layernorm, 1e-5, 1, [True, True, layernorm, True, True]))
    check_op(torch.ops.coda.norm_mlp_backward.default,
             (randn(m, d), x, g, b, w, w2, h, randn(m, n), no_mean, rstd, s, t, True, False, True, layernorm, 1e-5, 1,
              [True, True, layernorm, True, True, True, False]))
    check_op(torch.ops.coda.linear_residual.default,
             (grads[0], randn(d, d, scale=d**-0.5).requires_grad_(True), None, randn(m, d), layernorm, 1e-5))
