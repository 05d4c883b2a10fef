"""CPU tests of the LM head + cross-entropy: the reference path
against torch.nn.functional.cross_entropy's semantics (ignore_index, the
three reductions, label smoothing, an all-ignored batch) and against the
formulas for softcapping and z-loss; the argument errors; and the kernel
path's op call, fakes and C++ autograd through a CPU stand-in for the op,
eager and under torch.compile(fullgraph=True)."""

import pytest
import torch
import torch.nn.functional as F

from coda import ops
from coda.ops.loss import dw_head_rows
from helpers import compiled_once, cpu_stand_in


def _data(m=40, d=16, v=37, seed=0, ignored=0.25):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, d, generator=g, dtype=torch.float64), torch.randn(v, d, generator=g, dtype=torch.float64)
    b = torch.randn(v, generator=g, dtype=torch.float64)
    t = torch.randint(0, v, (m,), generator=g)
    t[torch.rand(m, generator=g) < ignored] = -100
    return x, w, b, t


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_reference_is_torch_cross_entropy(reduction, label_smoothing):
    x, w, b, t = _data()
    got = ops.linear_cross_entropy(x, w, t, b, reduction=reduction, label_smoothing=label_smoothing)
    want = F.cross_entropy(F.linear(x, w, b), t, reduction=reduction, label_smoothing=label_smoothing)
    torch.testing.assert_close(got, want.float() if got.dtype == torch.float32 else want)


def test_leading_dims_and_ignore_index():
    x, w, b, t = _data(m=24, ignored=0.0)
    x3, t3 = x.view(2, 12, -1), t.view(2, 12).clone()
    t3[0, :3] = 5
    got = ops.linear_cross_entropy(x3, w, t3, ignore_index=5, reduction="none")
    assert got.shape == (2, 12)
    want = F.cross_entropy(F.linear(x, w), t3.view(-1), ignore_index=5, reduction="none").view(2, 12)
    torch.testing.assert_close(got, want)


def test_int32_targets():
    # the check accepts int32 (the kernel path widens them): the reference path computes with them too
    x, w, b, t = _data()
    x.requires_grad_(True)
    for reduction in ("mean", "none"):
        got = ops.linear_cross_entropy(x, w, t.int(), b, reduction=reduction)
        torch.testing.assert_close(got, ops.linear_cross_entropy(x, w, t, b, reduction=reduction))
    ops.linear_cross_entropy(x, w, t.int(), b).backward()
    assert torch.isfinite(x.grad).all()


def test_all_ignored_batch():
    x, w, _, t = _data()
    t[:] = -100
    assert torch.isnan(ops.linear_cross_entropy(x, w, t))
    assert torch.isnan(F.cross_entropy(F.linear(x, w), t))
    assert ops.linear_cross_entropy(x, w, t, reduction="sum").item() == 0.0


def test_softcap_and_z_loss_formulas():
    x, w, _, t = _data(ignored=0.0)
    cap, z = 3.0, 1e-2
    logits = cap * torch.tanh(F.linear(x, w) / cap)
    want = (torch.logsumexp(logits, -1) - logits.gather(1, t[:, None])[:, 0] + z * torch.logsumexp(logits, -1) ** 2)
    got = ops.linear_cross_entropy(x, w, t, softcap=cap, z_loss=z, reduction="none")
    torch.testing.assert_close(got, want)


def test_norm_in_front():
    x, w, _, t = _data()
    g = torch.rand(x.shape[-1], dtype=torch.float64) + 0.5
    got = ops.linear_cross_entropy(x, w, t, norm_weight=g, norm_eps=1e-6)
    want = F.cross_entropy(F.linear(F.rms_norm(x, (x.shape[-1],), g, 1e-6), w), t)
    torch.testing.assert_close(got, want)


def test_errors_name_the_argument():
    x, w, b, t = _data()
    op = ops.linear_cross_entropy
    with pytest.raises(ValueError, match=r"target must be an int64 .* of shape \(40,\)"):
        op(x, w, t[:5])
    with pytest.raises(ValueError, match="target must be an int64"):
        op(x, w, t.float())
    with pytest.raises(ValueError, match=r"x has shape \(40, 16\), but weight \(37, 15\) takes 15"):
        op(x, w[:, :15], t)
    with pytest.raises(ValueError, match="reduction must be 'mean', 'sum' or 'none', got 'avg'"):
        op(x, w, t, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing must be a float in"):
        op(x, w, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match="softcap must be a positive float"):
        op(x, w, t, softcap=-1.0)
    with pytest.raises(ValueError, match=r"bias must have shape \(37,\)"):
        op(x, w, t, b[:3])
    with pytest.raises(ValueError, match="chunk_tokens must be a positive int"):
        op(x, w, t, chunk_tokens=0)
    with pytest.raises(ValueError, match="chunk_vocab must be a positive int"):
        op(x, w, t, chunk_vocab=-8)
    with pytest.raises(ValueError, match="weight has no rows"):
        op(x, w[:0], t)


# ---- the kernel path's call, its fakes and its C++ autograd (a CPU stand-in for the op)

def _grads(x, w, b, t, ii, ls, cap, z, scale, needs):
    """The gradients in closed form (the stand-in runs below autograd):
    d loss / d logits = softmax - (1 - ls)·onehot - ls/V on rows not ignored,
    times scale: () or one per row."""
    assert not cap and not z, "the stand-in covers label smoothing only"
    logits = F.linear(x, w, b)
    valid = (t != ii).to(x.dtype)[:, None]
    onehot = F.one_hot(t.clamp_min(0), w.shape[0]).to(x.dtype)
    g = (logits.softmax(-1) - (1 - ls) * onehot - ls / w.shape[0]) * valid * scale.reshape(-1, 1)
    full = [g @ w, g.t() @ x, g.sum(0) if b is not None else None]
    return [f if n and f is not None else x.new_empty(0) for f, n in zip(full, needs)]


def _lce_cpu(x, w, b, t, ii, ls, cap, z, red, chunk, needs):
    loss = ops.linear_cross_entropy_reference(x, w, t, b, ignore_index=ii, label_smoothing=ls, softcap=cap or None,
                                              z_loss=z, reduction=["none", "mean", "sum"][red]).float()
    lse = torch.logsumexp(F.linear(x, w, b).float(), -1).reshape(-1)
    # the gradients of the rows' sum (the backward scales them), dW and db in float32, and dX where D ≤ V/16
    grads = _grads(x, w, b, t, ii, ls, cap, z, torch.ones(()), needs) if red else [x.new_empty(0) for _ in range(3)]
    if red:
        grads[1:] = [g.float() if g.numel() else g for g in grads[1:]]
        if grads[0].numel() and (x.shape[-1] * 16 <= w.shape[0] or 4 * x.numel() <= 64 << 20):
            grads[0] = grads[0].float()
    # dW as its head rows and the rest (loss_ops.cpp's Grads)
    dx, dw, db = grads
    head = dw_head_rows(w.shape[0])
    return loss, lse, dx, *((dw[:head].clone(), dw[head:].clone()) if dw.numel() else (dw, x.new_empty(0))), db


def _lce_backward_cpu(grad, x, w, b, t, lse, ii, ls, cap, z, chunk, needs):
    return tuple(_grads(x, w, b, t, ii, ls, cap, z, grad, needs))


def _lce_loss_cpu(x, w, b, t, ii, ls, cap, z, red, chunk, recompute, chunk_vocab):
    return _lce_cpu(x, w, b, t, ii, ls, cap, z, red, chunk, [False] * 3)[:2]


def _lce_sliced_cpu(x, w, b, t, ii, ls, cap, z, red, chunk):
    return _lce_cpu(x, w, b, t, ii, ls, cap, z, red, chunk, [False] * 3)[:2]


@pytest.fixture
def stand_in(monkeypatch):
    yield from cpu_stand_in(monkeypatch, {"linear_cross_entropy": _lce_cpu,
                                          "linear_cross_entropy_backward": _lce_backward_cpu,
                                          "linear_cross_entropy_loss": _lce_loss_cpu,
                                          "linear_cross_entropy_sliced": _lce_sliced_cpu})


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("recompute", [True, False])
def test_kernel_path_autograd(stand_in, reduction, bias, recompute):
    x, w, b, t = (v.float() if v.is_floating_point() else v for v in _data())
    b = b if bias else None
    dl = torch.randn(t.shape) if reduction == "none" else torch.tensor(1.3)

    def grads_of(fn):
        ins = [v.detach().requires_grad_(True) if v is not None else None for v in (x, w, b)]
        loss = fn(ins)
        loss.backward(dl)
        return loss.detach(), [v.grad for v in ins if v is not None]

    def coda_fn(ins):
        return ops.linear_cross_entropy(ins[0], ins[1], t, ins[2], reduction=reduction, label_smoothing=0.1,
                                        recompute=recompute)

    def ref_fn(ins):
        return ops.linear_cross_entropy_reference(ins[0], ins[1], t, ins[2], reduction=reduction,
                                                  label_smoothing=0.1)

    loss, grads = grads_of(coda_fn)
    loss_ref, grads_ref = grads_of(ref_fn)
    torch.testing.assert_close(loss, loss_ref)
    for g, r in zip(grads, grads_ref):
        torch.testing.assert_close(g, r)
    with torch.no_grad():
        compiled = compiled_once(lambda: coda_fn([x, w, b]))
    torch.testing.assert_close(compiled, loss)


def test_kernel_path_fakes(stand_in):
    x, w, b, t = (v.float() if v.is_floating_point() else v for v in _data())
    for red in (0, 1, 2):
        torch.library.opcheck(torch.ops.coda.linear_cross_entropy_loss.default,
                              (x, w, b, t, -100, 0.1, 0.0, 0.0, red, 8, True, 16),
                              test_utils=("test_schema", "test_faketensor"))
        torch.library.opcheck(torch.ops.coda.linear_cross_entropy.default,
                              (x, w, b, t, -100, 0.0, 0.0, 0.0, red, 8, [True, True, True]),
                              test_utils=("test_schema", "test_faketensor"))
    lse = torch.logsumexp(F.linear(x, w, b), -1)
    for red in (0, 1, 2):
        torch.library.opcheck(torch.ops.coda.linear_cross_entropy_sliced.default,
                              (x, w, b, t, -100, 0.1, 0.0, 0.0, red, 16), test_utils=("test_schema", "test_faketensor"))
    for grad in (torch.tensor(0.3), torch.randn(t.shape)):
        torch.library.opcheck(torch.ops.coda.linear_cross_entropy_backward.default,
                              (grad, x, w, b, t, lse, -100, 0.1, 0.0, 0.0, 16, [True, True, True]),
                              test_utils=("test_schema", "test_faketensor"))


def test_forward_gradients_allow_one_backward(stand_in):
    """recompute=False scales the forward's gradients in place: a second backward would scale them twice."""
    x, w, b, t = (v.float() if v.is_floating_point() else v for v in _data())
    xl = x.detach().requires_grad_(True)
    loss = ops.linear_cross_entropy(xl, w, t, recompute=False)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs one backward"):
        loss.backward()
    xr = x.detach().requires_grad_(True)
    loss = ops.linear_cross_entropy(xr, w, t)
    loss.backward(retain_graph=True)
    loss.backward()  # the recomputing backward runs again
    torch.testing.assert_close(xr.grad, 2 * xl.grad)
