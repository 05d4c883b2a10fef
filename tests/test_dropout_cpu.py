"""coda.ops.dropout_residual (GPT-2's residual dropout with its add and the next norm's statistics)
where no GPU is: the reference path draws nn.Dropout's masks from torch's generator; the C++ op's
autograd hands its backward the forward's rng_state and p (x's gradient the masked dy, the
residual's dy itself), checked with CPU stand-ins that regenerate a mask from rng_state as the
kernel does; its fakes under torch.compile(fullgraph=True); bad arguments."""

import pytest
import torch
import torch.nn.functional as F

from helpers import cpu_stand_in

from coda import ops


def _inputs(dtype=torch.float64):
    torch.manual_seed(0)
    return torch.randn(3, 5, 32, dtype=dtype) + 3, torch.randn(3, 5, 32, dtype=dtype)  # x away from 0: kept = y != r


def test_reference_draws_nn_dropouts_mask():
    x, r = _inputs()
    torch.manual_seed(7)
    got = ops.dropout_residual(x, r, 0.1)
    torch.manual_seed(7)
    assert torch.equal(got, r + F.dropout(x, 0.1, training=True))
    torch.manual_seed(7)
    y, stats = ops.dropout_residual(x, r, 0.1, "LayerNorm", 1e-5)
    assert torch.equal(y, got) and stats.shape == (3, 5, 2)
    var, mean = torch.var_mean(y.float(), -1, correction=0)
    torch.testing.assert_close(stats[..., 0], mean)
    torch.testing.assert_close(stats[..., 1], torch.rsqrt(var + 1e-5))


def test_bad_arguments_name_what_was_expected():
    x, r = _inputs()
    with pytest.raises(ValueError, match=r"p must be a float in \[0, 1\)"):
        ops.dropout_residual(x, r, 1.0)
    with pytest.raises(ValueError, match=r"residual must have shape \(3, 5, 32\)"):
        ops.dropout_residual(x, r[:, :2], 0.1)
    with pytest.raises(ValueError, match="normalization must be 'LayerNorm' or 'RMSNorm'"):
        ops.dropout_residual(x, r, 0.1, "BatchNorm")


def _mask(rng_state, shape, p):
    g = torch.Generator().manual_seed(int(rng_state[0]) * 1000003 + int(rng_state[1]))
    return (torch.rand(shape, generator=g, dtype=torch.float64) >= p).to(torch.float64)


def _forward(x, residual, p, want_stats, layernorm, eps):
    rng_state = torch.randint(0, 2**31, (2,), dtype=torch.int64)
    y = residual + x * _mask(rng_state, x.shape, p).to(x.dtype) / (1 - p)
    stats = torch.zeros(2, y.reshape(-1, y.shape[-1]).shape[0], dtype=torch.float32)
    return y, stats if want_stats else torch.zeros(0), rng_state


def _backward(dy, rng_state, p):
    return dy * _mask(rng_state, dy.shape, p).to(dy.dtype) / (1 - p)


@pytest.fixture
def cpu_ops(monkeypatch):
    yield from cpu_stand_in(monkeypatch, {"dropout_residual": _forward, "dropout_backward": _backward})


def test_op_backward_regenerates_the_forwards_mask(cpu_ops):
    x, r = _inputs()
    xl, rl = x.clone().requires_grad_(True), r.clone().requires_grad_(True)
    y = ops.dropout_residual(xl, rl, 0.25)
    kept = (y.detach() != r).to(x.dtype)
    assert 0 < kept.mean() < 1
    dy = torch.randn_like(x)
    y.backward(dy)
    torch.testing.assert_close(xl.grad, dy * kept / 0.75)
    assert torch.equal(rl.grad, dy)


def test_op_traces_whole_under_compile(cpu_ops):
    x, r = _inputs(torch.float32)
    xl, rl = x.clone().requires_grad_(True), r.clone().requires_grad_(True)
    fn = lambda x, r: ops.dropout_residual(x, r, 0.25, "LayerNorm", 1e-5)  # noqa: E731
    torch._dynamo.reset()
    try:
        y, stats = torch.compile(fn, fullgraph=True, backend="aot_eager")(xl, rl)
        kept = (y.detach() != r).to(x.dtype)
        dy = torch.randn_like(x)
        y.backward(dy)
    finally:
        torch._dynamo.reset()
    assert stats.shape == (3, 5, 2)
    torch.testing.assert_close(xl.grad, dy * kept / 0.75)
    assert torch.equal(rl.grad, dy)
