"""coda.ops.head_norm_rope (Qwen3's / Gemma 3's per-head RMSNorm, then RoPE) where no GPU is:
the reference path against a float64 loop over heads and pairs; the backward's formulas (the
ones the CUDA kernel implements: dN = R(−φ)·dY, dx = rstd·(g − n̂·mean(g ⊙ n̂)), dγ = Σ dN ⊙ n̂)
against autograd of the reference, through the C++ op's autograd with CPU stand-ins for the
kernels; its fakes under torch.compile(fullgraph=True); bad arguments."""

import pytest
import torch

from helpers import cpu_stand_in

from coda import _kernels, ops


def _inputs(b=2, s=5, heads=3, hd=64, dtype=torch.float64):
    torch.manual_seed(0)
    x = torch.randn(b, s, heads, hd, dtype=dtype)
    w = (1 + 0.2 * torch.randn(hd)).to(dtype)
    pos = torch.randint(0, 4096, (b, s))
    inv_freq = (1e4 ** (-torch.arange(hd // 2, dtype=torch.float64) / (hd // 2))).to(torch.float32)
    return x, w, pos, inv_freq


def test_reference_normalizes_each_head_then_rotates_adjacent_pairs():
    x, w, pos, inv_freq = _inputs()
    eps = 1e-6
    out = ops.head_norm_rope(x, w, pos, inv_freq, eps)
    expect = torch.empty_like(x)
    for bi in range(x.shape[0]):
        for si in range(x.shape[1]):
            angle = (pos[bi, si].to(torch.float32) * inv_freq).double()  # float32 angles, as Hugging Face's
            for h in range(x.shape[2]):
                v = x[bi, si, h]
                n = v / torch.sqrt(v.square().mean() + eps) * w
                for j in range(x.shape[3] // 2):
                    c, s = torch.cos(angle[j]), torch.sin(angle[j])
                    expect[bi, si, h, 2 * j] = n[2 * j] * c - n[2 * j + 1] * s
                    expect[bi, si, h, 2 * j + 1] = n[2 * j + 1] * c + n[2 * j] * s
    torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-6)  # cos and sin of a float32 angle in float32


def test_positions_broadcast_over_the_batch():
    x, w, pos, inv_freq = _inputs()
    one = pos[:1]
    torch.testing.assert_close(ops.head_norm_rope(x, w, one, inv_freq, 1e-6),
                               ops.head_norm_rope(x, w, one.expand(2, -1), inv_freq, 1e-6))


def test_bad_arguments_name_what_was_expected():
    x, w, pos, inv_freq = _inputs()
    with pytest.raises(ValueError, match=r"weight must be \(head_dim,\) = \(64,\)"):
        ops.head_norm_rope(x, w[:4], pos, inv_freq, 1e-6)
    with pytest.raises(ValueError, match=r"inv_freq must be \(head_dim / 2,\) = \(32,\)"):
        ops.head_norm_rope(x, w, pos, inv_freq[:3], 1e-6)
    with pytest.raises(TypeError, match="positions must be an integer tensor"):
        ops.head_norm_rope(x, w, pos.float(), inv_freq, 1e-6)
    with pytest.raises(ValueError, match=r"x must be \(..., heads, head_dim\)"):
        ops.head_norm_rope(x[0, 0, 0], w, pos, inv_freq, 1e-6)


# ---- the op's C++ autograd with the backward's formulas standing in for the kernels

def _rotate(t, pos, inv_freq, sign):
    angle = pos.to(torch.float32)[..., None, None] * inv_freq
    c, s = angle.cos().to(t.dtype), (sign * angle.sin()).to(t.dtype)
    even, odd = t.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((even * c - odd * s, odd * c + even * s), -1).flatten(-2)


def _forward(x, weight, positions, inv_freq, eps):
    return ops.head_norm_rope_reference(x, weight, positions.expand(x.shape[:-2]), inv_freq, eps)


def _backward(dy, x, weight, positions, inv_freq, eps, needs):
    pos = positions.expand(x.shape[:-2])
    rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    xhat = x * rstd
    dn = _rotate(dy, pos, inv_freq, -1.0)  # R(−φ)·dY
    g = dn * weight
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dn * xhat).reshape(-1, x.shape[-1]).sum(0)
    return (dx if needs[0] else x.new_empty(0)), (dw if needs[1] else x.new_empty(0))


@pytest.fixture
def cpu_ops(monkeypatch):
    yield from cpu_stand_in(monkeypatch, {"head_norm_rope": _forward, "head_norm_rope_backward": _backward})


def test_op_gradients_are_the_references(cpu_ops):
    x, w, pos, inv_freq = _inputs()
    dy = torch.randn_like(x)
    grads = []
    for fn in (ops.head_norm_rope, ops.head_norm_rope_reference):
        xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = fn(xl, wl, pos.expand(x.shape[:-2]), inv_freq, 1e-6)
        y.backward(dy)
        grads.append((y.detach(), xl.grad, wl.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    # only x's gradient asked for: the weight's is not formed
    xl = x.clone().requires_grad_(True)
    ops.head_norm_rope(xl, w, pos, inv_freq, 1e-6).backward(dy)
    torch.testing.assert_close(xl.grad, grads[1][1], rtol=1e-10, atol=1e-10)


def test_op_traces_whole_under_compile(cpu_ops):
    # the C++ autograd traced by AOTAutograd through the fakes, the backward run from the graph
    x, w, pos, inv_freq = _inputs(dtype=torch.float32)
    dy = torch.randn_like(x)
    results = []
    for compile_it in (True, False):
        xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        fn = lambda x, w: ops.head_norm_rope(x, w, pos, inv_freq, 1e-6)  # noqa: E731
        torch._dynamo.reset()
        try:
            y = (torch.compile(fn, fullgraph=True, backend="aot_eager") if compile_it else fn)(xl, wl)
            y.backward(dy)
        finally:
            torch._dynamo.reset()
        results.append((y.detach(), xl.grad, wl.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def test_head_dims_without_a_kernel_take_the_reference(monkeypatch):
    calls = []

    def forward(*args):
        calls.append(args)
        return _forward(*args)

    gen = cpu_stand_in(monkeypatch, {"head_norm_rope": forward, "head_norm_rope_backward": _backward})
    next(gen)
    try:
        x, w, pos, inv_freq = _inputs(hd=8)
        ops.head_norm_rope(x, w, pos, inv_freq, 1e-6)
        assert calls == []  # head_dim 8: the reference, not the op
        x, w, pos, inv_freq = _inputs(hd=64)
        ops.head_norm_rope(x, w, pos, inv_freq, 1e-6)
        assert len(calls) == 1
    finally:
        next(gen, None)
