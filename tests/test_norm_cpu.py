"""The norm-GEMM ops and modules on the reference path (CPU): values,
precomputed statistics, eps, errors, state_dict loading and the explicit
weight fold. On an H200 the same ops run the folded kernels
(tests/test_gpu_norm.py)."""

import pytest
import torch
import torch.nn.functional as F

import coda
from coda import ops
from helpers import rel_err


def ln_inputs(m=6, d=16, n=24, dtype=torch.float64, offset=0.0):
    x = torch.randn(m, d, dtype=dtype) + offset * torch.randn(m, 1, dtype=dtype)
    return x, 1 + 0.1 * torch.randn(d, dtype=dtype), 0.1 * torch.randn(d, dtype=dtype), \
        torch.randn(n, d, dtype=dtype) / d**0.5, torch.randn(n, dtype=dtype)


@pytest.mark.parametrize("activation", [None, "gelu_tanh", "silu"])
def test_layernorm_linear_matches_reference(activation, seed):
    x, g, b, w, bias = ln_inputs()
    out = ops.layernorm_linear(x, g, b, w, bias, activation=activation)
    ref = ops.linear_reference(F.layer_norm(x, (16,), g, b, 1e-5), w, bias, activation)
    assert rel_err(out, ref) < 1e-12, seed


def test_rmsnorm_linear_matches_reference(seed):
    x, g, _, w, _ = ln_inputs()
    out = ops.rmsnorm_linear(x, g, w, eps=1e-6, activation="relu")
    assert rel_err(out, torch.relu(F.linear(F.rms_norm(x, (16,), g, 1e-6), w))) < 1e-12, seed


def test_rmsnorm_eps_defaults_like_nn_rmsnorm():
    # None: the dtype's machine epsilon, as F.rms_norm / nn.RMSNorm take it.
    x, g, _, w, _ = ln_inputs(dtype=torch.float32)
    torch.testing.assert_close(ops.rmsnorm_linear(x, g, w), F.linear(F.rms_norm(x, (16,), g), w))
    m = coda.nn.RMSNormLinear(16, 24)
    assert m.norm.eps is None
    torch.testing.assert_close(m(x), m.linear(m.norm(x)))
    m = coda.nn.LayerNormLinear(16, 24, normalization="RMSNorm", eps=1e-3)
    assert m.norm.eps == 1e-3
    torch.testing.assert_close(m(x), m.linear(m.norm(x)))
    assert coda.nn.LayerNormMLP(16, 32).norm.eps == 1e-5


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_linear_residual_stats_feed_the_next_norm(normalization, seed):
    x, g, b, w, bias = ln_inputs(d=16, n=16, offset=5.0)
    r, w2 = torch.randn(6, 16, dtype=torch.float64), torch.randn(24, 16, dtype=torch.float64)
    y, stats = ops.linear_residual(x, w, bias, r, normalization=normalization)
    assert stats.shape == (6, 2) and stats.dtype == torch.float32
    torch.testing.assert_close(y, F.linear(x, w, bias) + r)
    if normalization == "LayerNorm":
        with_stats, without = ops.layernorm_linear(y, g, b, w2, stats=stats), ops.layernorm_linear(y, g, b, w2)
    else:
        assert torch.equal(stats[:, 0], torch.zeros(6))
        with_stats = ops.rmsnorm_linear(y, g, w2, eps=1e-5, stats=stats)
        without = ops.rmsnorm_linear(y, g, w2, eps=1e-5)
    assert rel_err(with_stats, without) < 1e-5, seed  # fp32 statistics of fp64 rows (offset 5: ~1e-6 seen)


def test_stats_with_leading_dims_round_trip():
    y = torch.randn(2, 3, 16)
    stats = ops.row_stats(y, "LayerNorm")
    assert stats.shape == (2, 3, 2)
    torch.testing.assert_close(stats[..., 0], y.mean(-1))
    out = ops.layernorm_linear(y, torch.ones(16), torch.zeros(16), torch.eye(16), stats=stats)
    torch.testing.assert_close(out, F.layer_norm(y, (16,)), atol=1e-5, rtol=1e-5)


def test_gradients_through_given_stats_are_the_true_norms():
    # Stats passed in give the value; the gradient is that of the norm of x.
    x, g, b, w, bias = ln_inputs(m=4, d=8, n=12)
    stats = ops.row_stats(x, "LayerNorm")
    inputs = [t.requires_grad_(True) for t in (x, g, b, w, bias)]
    ops.layernorm_linear(*inputs, stats=stats).square().sum().backward()
    with_stats = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    ops.layernorm_linear(*inputs).square().sum().backward()
    for a, t in zip(with_stats, inputs):
        torch.testing.assert_close(a, t.grad, atol=1e-5, rtol=1e-5)


def test_constant_rows_and_tiny_eps():
    x = torch.full((4, 16), 3.0)
    _, g, b, w, bias = ln_inputs(m=4, dtype=torch.float32)
    for eps in (1e-5, 1e-12):
        out = ops.layernorm_linear(x, g, b, w, bias, eps=eps)
        torch.testing.assert_close(out, F.linear(b, w, bias).expand(4, -1), atol=1e-4, rtol=1e-4)


def test_norm_errors():
    x, g, b, w, _ = ln_inputs()
    with pytest.raises(ValueError, match=r"norm_weight must have shape \(16,\)"):
        ops.layernorm_linear(x, g[:8], b, w)
    with pytest.raises(ValueError, match=r"stats must be a float32 tensor of shape \(6, 2\)"):
        ops.layernorm_linear(x, g, b, w, stats=torch.zeros(6, 3))
    with pytest.raises(ValueError, match="normalization must be 'LayerNorm' or 'RMSNorm'"):
        ops.linear_residual(x, w, None, torch.zeros(6, 24), normalization="batchnorm")
    with pytest.raises(ValueError, match=r"residual must have shape \(6, 24\)"):
        ops.linear_residual(x, w, None, torch.zeros(6, 16))
    with pytest.raises(ValueError, match="normalization must be 'LayerNorm' or 'RMSNorm'"):
        coda.nn.LayerNormLinear(16, 8, normalization="GroupNorm")
    with pytest.raises(ValueError, match=r"x has shape \(6, 16\), but weight \(24, 12\) takes 12"):
        ops.layernorm_linear(x, g, b, w[:, :12])
    with pytest.raises(ValueError, match="eps must be a finite float"):
        ops.layernorm_linear(x, g, b, w, eps=-1.0)


def test_norm_mlp_errors():
    x, g, b, w1, b1 = ln_inputs(m=4, d=8, n=12)
    w2 = torch.randn(8, 12, dtype=torch.float64)
    with pytest.raises(ValueError, match="norm_bias must be None for RMSNorm"):
        ops.norm_mlp(x, g, b, w1, b1, w2, None, "RMSNorm")
    with pytest.raises(ValueError, match=r"fc1's output \(w1\) has shape \(4, 12\), but w2 \(8, 8\) takes 8"):
        ops.norm_mlp(x, g, b, w1, b1, w2[:, :8], None)
    with pytest.raises(ValueError, match=r"residual must have shape \(4, 8\)"):
        ops.norm_mlp(x, g, b, w1, b1, w2, None, residual=torch.zeros(4, 7, dtype=torch.float64))


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_norm_mlp_return_stats(normalization):
    # GPT-2's chain: y and the next norm's (mean, rstd) of y, float32 (..., 2), as row_stats computes them
    layernorm = normalization == "LayerNorm"
    x, g, b, w1, b1 = ln_inputs(m=6, d=16, n=24)
    x = x.view(2, 3, 16)
    b = b if layernorm else None
    w2 = torch.randn(16, 24, dtype=torch.float64)
    y0 = ops.norm_mlp(x, g, b, w1, b1, w2, None, normalization, 1e-5, residual=x)
    y, st = ops.norm_mlp(x, g, b, w1, b1, w2, None, normalization, 1e-5, residual=x, return_stats=True)
    torch.testing.assert_close(y, y0)
    assert st.shape == (2, 3, 2) and st.dtype == torch.float32 and not st.requires_grad
    torch.testing.assert_close(st, ops.row_stats(y, normalization, 1e-5))
    ref = ops.norm_mlp_reference(x, g, b, w1, b1, w2, None, normalization, 1e-5, residual=x, return_stats=True)
    torch.testing.assert_close(ref[1], st)
    # and the next norm-GEMM takes them
    w = torch.randn(8, 16, dtype=torch.float64)
    nxt = ops.layernorm_linear if layernorm else (lambda h, g, b, w, **kw: ops.rmsnorm_linear(h, g, w, **kw))
    torch.testing.assert_close(nxt(y, g, b, w, eps=1e-5, stats=st), nxt(y, g, b, w, eps=1e-5), rtol=1e-5, atol=1e-6)
    mlp = coda.nn.LayerNormMLP(16, 24, normalization=normalization, dtype=torch.float64)
    out, st_m = mlp(x, residual=x, return_stats=True)
    torch.testing.assert_close(st_m, ops.row_stats(out, normalization, mlp.norm.eps))


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
    r = coda.nn.RMSNormLinear(16, 8, eps=1e-6)
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


def test_fold_reference_cancels_with_the_rounded_weight():
    _, g, b, w, bias = ln_inputs(dtype=torch.bfloat16)
    folded = ops.fold_norm_weight(w, g, b, bias)
    assert folded.weight.dtype == torch.bfloat16 and folded.col_sum.dtype == torch.float32
    assert torch.equal(folded.col_sum, folded.weight.float().sum(-1))  # s from the rounded W̃, not from W∘γ
    torch.testing.assert_close(folded.shift, w.float() @ b.float() + bias.float())
    assert ops.fold_norm_weight(w, g, None, None, "RMSNorm").col_sum is None


# ---- the explicit fold a module keeps for inference (coda/nn/_fold.py)

def test_fold_is_kept_only_when_asked_and_dropped_on_unfold():
    m = coda.nn.LayerNormLinear(16, 24)
    assert m._fold.folded is None
    with torch.no_grad():
        m(torch.randn(3, 16))
    assert m._fold.folded is None  # no cache behind the user's back
    m.fold_weights()
    assert m._fold.folded is not None
    m.unfold_weights()
    assert m._fold.folded is None


def test_fold_with_inference_mode_parameters():
    with torch.inference_mode():
        m = coda.nn.LayerNormMLP(16, 32)
        m.fold_weights()
        x = torch.randn(3, 16)
        torch.testing.assert_close(m(x), m.fc2(F.gelu(m.fc1(m.norm(x)), approximate="tanh")))


def test_fold_follows_load_state_dict_in_place():
    m = coda.nn.LayerNormLinear(16, 24).fold_weights()
    kept = m._fold.folded.weight
    other = coda.nn.LayerNormLinear(16, 24)
    with torch.no_grad():
        other.norm.weight.normal_()
    m.load_state_dict(other.state_dict())
    assert m._fold.folded.weight is kept  # the same storage: a captured CUDA graph sees the new fold
    torch.testing.assert_close(kept, ops.fold_norm_weight(other.linear.weight, other.norm.weight, other.norm.bias,
                                                          other.linear.bias).weight)


def test_fold_follows_in_place_updates():
    m = coda.nn.LayerNormLinear(16, 24).fold_weights()
    with torch.no_grad():
        m.linear.weight.mul_(-2)
        x = torch.randn(3, 16)
        m(x)
    torch.testing.assert_close(m._fold.folded.weight, ops.fold_norm_weight(m.linear.weight, m.norm.weight,
                                                                           m.norm.bias, m.linear.bias).weight)


def test_fold_is_not_used_when_training():
    m = coda.nn.LayerNormLinear(16, 24).fold_weights()
    x = torch.randn(3, 16)
    assert m.folded_for(x) is None  # parameters require grad, grad is on
    with torch.no_grad():
        assert m.folded_for(x) is not None
    coda.nn.unfold_weights(m)
    assert m._fold.folded is None
