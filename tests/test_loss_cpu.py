"""CPU tests of the LM head + cross-entropy: the reference path
against torch.nn.functional.cross_entropy's semantics (ignore_index, the
three reductions, label smoothing, an all-ignored batch) and against the
formulas for softcapping and z-loss; the argument errors; and the loss
ops' host registration: the C++ orchestration the GPU runs (chunks of
tokens, slices of the vocabulary, the three recompute modes, the float32 dW
in the gradient's own bytes, the scaling in the backward) on CPU tensors,
every output and gradient against float64 within the error of torch's
unfused bf16 path, its fakes by opcheck, and torch.compile(fullgraph=True)."""

import pytest
import torch
import torch.nn.functional as F

from coda import _kernels, ops
from coda.ops.loss import dw_head_rows
from helpers import check_linear_cross_entropy, rel_err, run, within_torch_error


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


# ---- the loss ops' host registration: the kernel path's orchestration on CPU tensors

BF16 = torch.bfloat16


@pytest.fixture
def host(monkeypatch):
    """Every call takes the kernel path (the public API keeps CPU tensors on the reference path)."""
    if not _kernels.available():
        pytest.skip(f"the extension coda._C is not built ({_kernels.LOAD_ERROR})")
    monkeypatch.setattr(_kernels, "use_kernels", lambda op, x, dtypes, sizes, unsupported=None: unsupported is None)


def _inputs(m, d, v, dtype=BF16, seed=0, ignored=0.1, scale=1.0, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=g).to(dtype)
    w = (torch.randn(v, d, generator=g) * scale * d**-0.5).to(dtype)
    t = torch.randint(0, v, (m,), generator=g)
    drop = torch.rand(m, generator=g) < ignored
    drop[0] = False
    t[drop] = -100
    b = torch.randn(v, generator=g).to(dtype) if bias else None
    return x, w, b, t


def _run(fn, x, w, b, dl):
    return run(fn, [x, w, b], dl)


def check_host(name, x, w, b, t, **kw):
    return check_linear_cross_entropy(name, [x, w, b], t, **kw)


RECOMPUTE = [True, False, "half"]


@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("m,d,v", [(200, 64, 37), (96, 32, 1003), (64, 16, 4099)])
def test_host_path_against_float64(host, m, d, v, reduction, recompute):
    x, w, b, t = _inputs(m, d, v, bias=True)
    check_host(f"host {m}x{d}x{v} {reduction} recompute={recompute}", x, w, b, t, reduction=reduction,
               recompute=recompute)


@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("option", [dict(label_smoothing=0.1), dict(softcap=3.0), dict(z_loss=1e-3),
                                    dict(label_smoothing=0.05, softcap=2.0, z_loss=1e-2, ignore_index=7)])
def test_host_path_options(host, option, recompute):
    x, w, b, t = _inputs(150, 32, 1003, scale=3.0)
    if "ignore_index" in option:
        t[t == -100] = option["ignore_index"]
    check_host(f"host {option} recompute={recompute}", x, w, b, t, recompute=recompute, **option)


@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("chunks", [dict(chunk_tokens=1), dict(chunk_tokens=7, chunk_vocab=16),
                                    dict(chunk_tokens=64, chunk_vocab=300), dict(chunk_vocab=1)])
def test_host_chunks_and_slices(host, chunks, recompute):
    """Many chunks of tokens and slices of the vocabulary, the last of each short; targets in every slice."""
    x, w, b, t = _inputs(101, 32, 1003, bias=True)
    check_host(f"host {chunks} recompute={recompute}", x, w, b, t, recompute=recompute, label_smoothing=0.1,
               **chunks)


@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_host_fp16_prescaled_mean(host, reduction, recompute):
    """fp16: a mean's forward gradients come prescaled (they would underflow); few classes, large dW rows."""
    x, w, _, t = _inputs(512, 32, 600, dtype=torch.float16, ignored=0.2)
    t[t >= 0] %= 8
    check_host(f"host fp16 {reduction} recompute={recompute}", x, w, None, t, reduction=reduction,
               recompute=recompute)


@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_host_all_ignored(host, recompute):
    x, w, b, t = _inputs(40, 16, 37, bias=True)
    t[:] = -100
    for reduction in ("mean", "sum", "none"):
        ins = [v.detach().requires_grad_(True) for v in (x, w, b)]
        loss = ops.linear_cross_entropy(*ins[:2], t, ins[2], reduction=reduction, recompute=recompute)
        assert torch.isnan(loss) if reduction == "mean" else torch.all(loss == 0)
        loss.sum().backward()
        assert all(torch.all(v.grad == 0) for v in ins), reduction


@pytest.mark.parametrize("recompute", [False, "half"])
@pytest.mark.parametrize("v", [37, 1003, 9])
def test_host_dw_in_its_own_bytes(host, v, recompute):
    """The bf16 dW is the float32 head's bytes: the head rounded in place, the rest after it (False: the
    forward's tail; "half": recomputed into them), no other buffer; "half" holds no tail from the forward."""
    x, w, _, t = _inputs(60, 16, v)
    wl = w.detach().requires_grad_(True)
    loss = ops.linear_cross_entropy(x, wl, t, recompute=recompute)
    loss.backward(torch.tensor(0.7))
    g = wl.grad
    assert g.dtype == BF16 and g.shape == (v, 16) and g.is_contiguous() and g.storage_offset() == 0
    assert g.untyped_storage().nbytes() == 4 * dw_head_rows(v) * 16
    args = (x, w, None, t, -100, 0.0, 0.0, 0.0, 1, 0, [False, True, False])
    tail = torch.ops.coda.linear_cross_entropy.default(*args, recompute is False)[4]
    assert tail.numel() == (0 if recompute == "half" else (v - dw_head_rows(v)) * 16)


@pytest.mark.parametrize("m", [1, 37, 200])
def test_host_recomputed_dx_in_its_own_bytes(host, m):
    """recompute=True: dX sums over the slices in float32 as x's first half of rows and the rest, rounded into
    the first's own bytes: the bf16 gradient is that storage (2 bytes an element beyond it while summing, not 4)."""
    x, w, b, t = _inputs(m, 16, 101)
    xl = x.detach().requires_grad_(True)
    ops.linear_cross_entropy(xl, w, t, chunk_vocab=16).backward(torch.tensor(0.7))
    g = xl.grad
    assert g.dtype == BF16 and g.shape == (m, 16) and g.is_contiguous() and g.storage_offset() == 0
    assert g.untyped_storage().nbytes() == 4 * dw_head_rows(m) * 16
    x64 = x.double().requires_grad_(True)
    (0.7 * ops.linear_cross_entropy_reference(x64, w.double(), t)).backward()
    xt = x.detach().requires_grad_(True)
    (0.7 * ops.linear_cross_entropy_reference(xt, w, t)).backward()
    within_torch_error(f"host recomputed dX m={m}", rel_err(g, x64.grad), rel_err(xt.grad, x64.grad),
                       numel=g.numel())


EPILOGUE_OPTIONS = [dict(), dict(label_smoothing=0.1, z_loss=1e-3), dict(softcap=3.0, ignore_index=7),
                    dict(reduction="none", label_smoothing=0.05)]


@pytest.mark.parametrize("recompute", [True, "half"])
@pytest.mark.parametrize("option", EPILOGUE_OPTIONS)
def test_host_grad_epilogue(host, option, recompute):
    """With lm_head_grad_epilogue, the recomputing backward's slices come from linear_cross_entropy_grad's
    formulas (the GEMM's epilogue on a GPU, its host mirror here) from the per-row vectors the op builds: within
    torch's error of float64, beside the unfused pass's result; the last slice of 1003 classes (width 43, no
    multiple of 8) runs unfused."""
    x, w, b, t = _inputs(150, 32, 1003, scale=3.0, bias=True)
    if "ignore_index" in option:
        t[t == -100] = option["ignore_index"]
    kw = dict(option, recompute=recompute, chunk_vocab=64)
    with _kernels.lm_head_grad_epilogue() as slices:
        loss, grads = check_host(f"host epilogue {option} recompute={recompute}", x, w, b, t, **kw)
        assert slices() > 0
    dl = torch.randn(t.shape, generator=torch.Generator().manual_seed(1)) if "reduction" in option else None
    with _kernels.lm_head_grad_epilogue():
        loss, grads = _run(lambda x, w, b: ops.linear_cross_entropy(x, w, t, b, **kw), x, w, b,
                           dl if dl is not None else torch.tensor(1.7))
    loss2, grads2 = _run(lambda x, w, b: ops.linear_cross_entropy(x, w, t, b, **kw), x, w, b,
                         dl if dl is not None else torch.tensor(1.7))
    torch.testing.assert_close(loss, loss2, rtol=0, atol=0)  # the forward is the same
    for g, g2 in zip(grads, grads2):
        assert rel_err(g, g2) < 5e-3


def test_host_grad_epilogue_rows():
    """Its per-row vectors: ignored rows' gradients are 0 and a target outside the vocabulary gives NaN."""
    if not _kernels.available():
        pytest.skip(f"the extension coda._C is not built ({_kernels.LOAD_ERROR})")
    x, w, b, t = _inputs(40, 16, 64)
    t[3], t[5] = -100, 64 + 9
    lse = torch.logsumexp(F.linear(x, w).float(), -1)
    with _kernels.lm_head_grad_epilogue() as slices:
        dx, dw, _ = torch.ops.coda.linear_cross_entropy_backward.default(
            torch.tensor(0.5), x, w, None, t, lse, -100, 0.0, 0.0, 0.0, 16, [True, True, False], 0)
        assert slices() == 4
    assert torch.all(dx[3] == 0) and torch.isnan(dx[5]).all() and torch.isfinite(dx[[0, 1, 2, 4]]).all()
    assert torch.isnan(dw).all()  # every class's dW sums over the NaN row


def test_host_backward_of_a_class_range(host):
    """linear_cross_entropy_backward over classes [first_class, V): the rows of the whole one."""
    x, w, b, t = _inputs(50, 16, 101, bias=True)
    lse = torch.logsumexp(F.linear(x, w, b).float(), -1)
    grad = torch.tensor(0.3)
    args = (grad, x, w, b, t, lse, -100, 0.1, 0.0, 0.0, 16)
    _, dw, db = torch.ops.coda.linear_cross_entropy_backward.default(*args, [True, True, True], 0)
    _, dw2, db2 = torch.ops.coda.linear_cross_entropy_backward.default(*args, [False, True, True], 56)
    assert dw2.shape == (45, 16) and db2.shape == (45,)
    torch.testing.assert_close(dw2, dw[56:], rtol=0, atol=0)
    torch.testing.assert_close(db2, db[56:], rtol=0, atol=0)


@pytest.mark.parametrize("recompute", [False, "half"])
def test_host_forward_gradients_allow_one_backward(host, recompute):
    """recompute=False and "half" scale the forward's gradients in place: a second backward would scale them
    twice; the recomputing backward runs again."""
    x, w, _, t = _inputs(40, 16, 37)
    xl = x.detach().requires_grad_(True)
    loss = ops.linear_cross_entropy(xl, w, t, recompute=recompute)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs one backward"):
        loss.backward()
    xr = x.detach().requires_grad_(True)
    loss = ops.linear_cross_entropy(xr, w, t)
    loss.backward(retain_graph=True)
    loss.backward()
    assert rel_err(xr.grad, 2 * xl.grad) < 1e-2  # two paths, each rounded once


def test_host_recompute_values_are_checked(host):
    x, w, _, t = _inputs(40, 16, 37)
    with pytest.raises(ValueError, match="recompute must be True, False or 'half', got 'tail'"):
        ops.linear_cross_entropy(x, w, t, recompute="tail")
    with pytest.raises(RuntimeError, match=r"recompute code must be 0 \(False\), 1 \(True\) or 2 .*, got 3"):
        torch.ops.coda.linear_cross_entropy_loss.default(x, w, None, t, -100, 0.0, 0.0, 0.0, 1, 0, 3, 0)


def test_host_fakes(host):
    """Each op's fake against its host kernel: shapes, dtypes, strides (opcheck)."""
    x, w, b, t = _inputs(60, 16, 101, bias=True)
    for red in (0, 1, 2):
        for recompute in (0, 1, 2):
            torch.library.opcheck(torch.ops.coda.linear_cross_entropy_loss.default,
                                  (x, w, b, t, -100, 0.1, 0.0, 0.0, red, 8, recompute, 16),
                                  test_utils=("test_schema", "test_faketensor"))
        for dw_tail in (True, False):
            torch.library.opcheck(torch.ops.coda.linear_cross_entropy.default,
                                  (x, w, b, t, -100, 0.0, 2.0, 0.0, red, 8, [True, True, True], dw_tail),
                                  test_utils=("test_schema", "test_faketensor"))
        torch.library.opcheck(torch.ops.coda.linear_cross_entropy_sliced.default,
                              (x, w, b, t, -100, 0.1, 0.0, 0.0, red, 16), test_utils=("test_schema", "test_faketensor"))
    lse = torch.logsumexp(F.linear(x, w, b).float(), -1)
    for grad in (torch.tensor(0.3), torch.randn(t.shape)):
        for first in (0, 56):
            torch.library.opcheck(torch.ops.coda.linear_cross_entropy_backward.default,
                                  (grad, x, w, b, t, lse, -100, 0.1, 0.0, 0.0, 16, [True, True, True], first),
                                  test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_host_compiled(host, recompute):
    """torch.compile(fullgraph=True) traces the op and its backward (out of place while traced): the same
    loss and gradients as eager."""
    x, w, b, t = _inputs(60, 16, 101, bias=True)

    def fn(x, w, b):
        return ops.linear_cross_entropy(x, w, t, b, label_smoothing=0.1, recompute=recompute, chunk_tokens=16,
                                        chunk_vocab=32)

    eager = _run(fn, x, w, b, torch.tensor(1.3))
    torch._dynamo.reset()
    try:
        compiled = _run(torch.compile(fn, fullgraph=True, backend="aot_eager"), x, w, b, torch.tensor(1.3))
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(compiled[0], eager[0])
    for g, e in zip(compiled[1], eager[1]):
        torch.testing.assert_close(g, e)
