"""GPU tests of the LM head + cross-entropy: the loss and every
gradient against float64, each within the error of the unfused torch bf16
path (F.linear, then F.cross_entropy on the logits) on the same fresh random
inputs, outputs poisoned first, in strict mode (a fallback raises); the
kernel's own launch seen by the profiler; vocabularies that are no multiple
of 8, ignored rows, an all-ignored batch, label smoothing, softcapping,
z-loss, large and peaked logits, bias, the RMSNorm in front, tied
embeddings, the chunking, its memory bound; opcheck and
torch.compile(fullgraph=True). Skipped without an sm_90 GPU."""

import pytest
import torch
import torch.nn.functional as F

from coda import _kernels, ops
from coda.ops.loss import dw_head_rows
from helpers import assert_ran, check_linear_cross_entropy, launches, leaves, rel_err, run, within_torch_error
from test_gpu import rand, strict  # noqa: F401  (strict: autouse)

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16


def targets(m, v, ignored=0.0, ignore_index=-100):
    """Random classes, about a fraction `ignored` of the rows ignored, never the first (a one-row batch drawn
    all-ignored has a NaN mean; the all-ignored tests cover that on purpose)."""
    t = torch.randint(0, v, (m,), device="cuda")
    if ignored:
        drop = torch.rand(m, device="cuda") < ignored
        drop[0] = False
        t[drop] = ignore_index
    return t


RECOMPUTE = [True, False, "half"]
check = check_linear_cross_entropy


SHAPES = [(1000, 1024, 32000), (777, 512, 50257), (300, 256, 128256), (64, 2048, 151936), (4096, 1024, 32001),
          (1, 512, 1000)]


@pytest.mark.parametrize("m,d,v", SHAPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_shapes_and_reductions(m, d, v, reduction, seed):
    x, w = rand(m, d, dtype=BF16), rand(v, d, dtype=BF16, scale=d**-0.5)
    check(f"lce {m}x{d}x{v} {reduction} seed={seed}", [x, w], targets(m, v, 0.1), reduction=reduction, tokens=m)


def test_the_kernel_ran():
    x, w, t = rand(256, 512, dtype=BF16), rand(5000, 512, dtype=BF16, scale=512**-0.5), targets(256, 5000)
    x.requires_grad_(True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ops.linear_cross_entropy(x, w, t).backward()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert any("cross_entropy_kernel" in n for n in names), sorted(set(names))[:20]


@pytest.mark.parametrize("option", [dict(label_smoothing=0.1), dict(softcap=30.0), dict(z_loss=1e-4),
                                    dict(label_smoothing=0.05, softcap=15.0, z_loss=1e-3, ignore_index=7)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_options(option, reduction, seed):
    m, d, v = 600, 512, 32000
    x, w = rand(m, d, dtype=BF16), rand(v, d, dtype=BF16, scale=3 * d**-0.5)
    t = targets(m, v, 0.2, option.get("ignore_index", -100))
    check(f"lce {option} {reduction} seed={seed}", [x, w], t, reduction=reduction, tokens=m, **option)


@pytest.mark.parametrize("scale", [30.0, 100.0])
def test_large_and_peaked_logits(scale, seed):
    """|logit| ~ 30-100, and rows whose target logit stands far above the rest."""
    m, d, v = 512, 256, 50257
    x, w = rand(m, d, dtype=BF16), rand(v, d, dtype=BF16, scale=scale * d**-0.5)
    t = targets(m, v)
    with torch.no_grad():  # half the rows peaked: the target's weight row aligned with x
        w[t[: m // 2]] = (x[: m // 2].float() * (scale / d)).to(BF16)
    check(f"lce large x{scale} seed={seed}", [x, w], t, tokens=m)


def test_bias_and_norm(seed):
    m, d, v = 700, 1024, 32000
    x, w = rand(m, d, dtype=BF16), rand(v, d, dtype=BF16, scale=d**-0.5)
    b, g = rand(v, dtype=BF16), (1 + 0.1 * rand(d, dtype=torch.float32)).to(BF16)
    check(f"lce bias+norm seed={seed}", [x, w, b, g], targets(m, v, 0.1), tokens=m, norm_eps=1e-5)


@pytest.mark.parametrize("chunk", [1, 100, 4096])
@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_chunk_sizes(chunk, recompute, seed):
    m, d, v = 1000, 512, 32000
    x, w = rand(m, d, dtype=BF16), rand(v, d, dtype=BF16, scale=d**-0.5)
    check(f"lce chunk {chunk} recompute={recompute} seed={seed}", [x, w], targets(m, v, 0.1), chunk_tokens=chunk,
          recompute=recompute, tokens=m)


@pytest.mark.parametrize("cols", [1, 1000, 20000, 50000])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_vocab_slices(cols, reduction, seed):
    """The recomputing backward's slices of the vocabulary: every target lands in one slice, the last one short."""
    m, d, v = 700, 512, 32003
    x, w, b = rand(m, d, dtype=BF16), rand(v, d, dtype=BF16, scale=d**-0.5), rand(v, dtype=BF16)
    check(f"lce slices {cols} {reduction} seed={seed}", [x, w, b], targets(m, v, 0.1), chunk_vocab=cols,
          reduction=reduction, label_smoothing=0.1, tokens=m)


@pytest.mark.parametrize("m,d,v", [(1000, 1024, 32000), (777, 512, 50257), (4096, 1024, 32001)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("recompute", [False, "half"])
def test_gradients_in_the_forward(m, d, v, reduction, recompute, seed):
    """recompute=False: the forward's gradients, scaled by the backward; "half": dW's second half of rows
    from the backward's recomputed logits."""
    x, w, b = rand(m, d, dtype=BF16), rand(v, d, dtype=BF16, scale=d**-0.5), rand(v, dtype=BF16)
    check(f"lce forward grads {m}x{d}x{v} {reduction} recompute={recompute} seed={seed}", [x, w, b],
          targets(m, v, 0.1), reduction=reduction, recompute=recompute, tokens=m)


@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_a_target_out_of_range_is_nan(recompute):
    """A bad label never trains silently: its row's loss and gradients are NaN (torch asserts on the device)."""
    x, w = rand(64, 256, dtype=BF16), rand(1000, 256, dtype=BF16, scale=256**-0.5)
    t = targets(64, 1000)
    t[5] = 1000 + 7
    xl, wl = leaves(x, w)
    per_row = ops.linear_cross_entropy(x, w, t, reduction="none")
    assert torch.isnan(per_row[5]) and torch.isfinite(per_row[torch.arange(64, device="cuda") != 5]).all()
    loss = ops.linear_cross_entropy(xl, wl, t, reduction="sum", recompute=recompute)
    assert torch.isnan(loss)
    loss.backward()
    assert torch.isnan(xl.grad[5]).all() and torch.isfinite(xl.grad[:5]).all()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("recompute", [False, "half"])
def test_fp16_gradients_in_the_forward(reduction, recompute, seed):
    """Few classes, large dW rows: recompute=False's float32 dW and its prescaled fp16 gradients stay finite and
    within torch's error."""
    m, d, v = 2048, 512, 8000
    x, w = rand(m, d, dtype=torch.float16), rand(v, d, dtype=torch.float16, scale=d**-0.5)
    t = torch.randint(0, 8, (m,), device="cuda")  # few classes: large dW rows
    check(f"lce fp16 forward grads {reduction} recompute={recompute} seed={seed}", [x, w], t, reduction=reduction,
          recompute=recompute, tokens=m)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_all_ignored_gradients_are_zero(reduction, recompute):
    x, w, b = rand(64, 256, dtype=BF16), rand(1000, 256, dtype=BF16, scale=256**-0.5), rand(1000, dtype=BF16)
    t = torch.full((64,), -100, device="cuda")
    xl, wl, bl = leaves(x, w, b)
    loss = ops.linear_cross_entropy(xl, wl, t, bl, reduction=reduction, recompute=recompute)
    loss.sum().backward()
    assert all(torch.all(g == 0) for g in (xl.grad, wl.grad, bl.grad))


@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_all_ignored_is_nan_with_zero_gradients(recompute):
    x, w = rand(64, 256, dtype=BF16), rand(1000, 256, dtype=BF16, scale=256**-0.5)
    t = torch.full((64,), -100, device="cuda")
    xl, wl = leaves(x, w)
    loss = ops.linear_cross_entropy(xl, wl, t, recompute=recompute)
    ref = F.cross_entropy(F.linear(x, w).float(), t)
    assert torch.isnan(loss) and torch.isnan(ref)
    loss.backward()
    assert torch.all(xl.grad == 0) and torch.all(wl.grad == 0)
    assert ops.linear_cross_entropy(x, w, t, reduction="sum").item() == 0.0


def test_tied_embedding(seed):
    """The LM head's weight is the embedding's: both gradients land on it."""
    m, d, v = 512, 512, 32000
    w, ids, t = rand(v, d, dtype=BF16, scale=d**-0.5), targets(m, v), targets(m, v)

    def model(loss_fn, w):
        h = F.embedding(ids, w) * 3.0
        return loss_fn(h, w, t)

    wl = leaves(w)[0]
    model(ops.linear_cross_entropy, wl).backward()
    w64 = leaves(w.double())[0]
    model(ops.linear_cross_entropy_reference, w64).backward()
    wt = leaves(w)[0]
    model(ops.linear_cross_entropy_reference, wt).backward()
    within_torch_error(f"lce tied dW seed={seed}", rel_err(wl.grad, w64.grad), rel_err(wt.grad, w64.grad),
                       numel=m * d)


@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_peak_memory_is_an_eighth_of_the_fp32_logits(recompute):
    m, d, v = 8192, 1024, 32000
    x, w, t = rand(m, d, dtype=BF16), rand(v, d, dtype=BF16, scale=d**-0.5), targets(m, v)
    xl, wl = leaves(x, w)
    ops.linear_cross_entropy(xl, wl, t, recompute=recompute).backward()  # cuBLAS's workspace, kept after
    xl.grad, wl.grad = None, None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ops.linear_cross_entropy(xl, wl, t, recompute=recompute).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - x.nbytes - w.nbytes  # beyond the two gradients
    # recompute=False also holds a float32 dW, whose first half of bytes becomes the gradient; "half" holds only
    # that first half
    bound = m * v * 4 / 8 + (2 * v * d if recompute is False else 0)
    assert extra <= bound + (4 << 20), f"extra {extra / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB"


ONE_READ_OPTIONS = [dict(), dict(label_smoothing=0.1, z_loss=1e-4), dict(softcap=30.0, ignore_index=7)]


@pytest.mark.parametrize("v", [1000, 32003, 50257, 128256, 151936])
@pytest.mark.parametrize("option", ONE_READ_OPTIONS)
def test_one_read_cross_entropy(v, option, seed):
    """The one-read kernel (a cluster of 1-3 CTAs holding each row in shared memory) for recompute=False's
    statistics-and-gradient pass: within torch's error of float64, beside the one-block-a-row kernel's loss and
    gradients, and it ran (its launch count), for vocabularies of one and of three slices, an odd tail, the options
    and ignored rows."""
    m, d = 700, 256
    x, w = rand(m, d, dtype=BF16), rand(v, d, dtype=BF16, scale=3 * d**-0.5)
    t = targets(m, v, 0.2, option.get("ignore_index", -100))
    with _kernels.cross_entropy_one_read() as launches:
        loss, grads = check(f"lce one read v={v} {option} seed={seed}", [x, w], t, recompute=False, tokens=m,
                            **option)
        assert launches() > 0
    loss2, grads2 = run(lambda x, w: ops.linear_cross_entropy(x, w, t, recompute=False, **option), [x, w],
                        torch.tensor(1.7, device="cuda"))
    torch.testing.assert_close(loss, loss2, rtol=1e-5, atol=0)
    for g, g2 in zip(grads, grads2):
        assert rel_err(g, g2) < 2e-3


@pytest.mark.parametrize("v", [1000, 32003, 50257, 128256])
@pytest.mark.parametrize("option", ONE_READ_OPTIONS + [dict(reduction="none", label_smoothing=0.05)])
@pytest.mark.parametrize("recompute", [True, "half"])
def test_grad_epilogue(v, option, recompute, seed):
    """lm_head_grad_epilogue: the recomputing backward's d loss / d logits from the epilogue of the GEMM that
    recomputes each slice (linear_ce_grad): within torch's error of float64, beside the unfused pass's
    gradients, and it ran (its program's launches), for vocabularies of one and of many slices, an odd last
    slice (unfused), the options and ignored rows."""
    m, d = 700, 256
    x, w, b = rand(m, d, dtype=BF16), rand(v, d, dtype=BF16, scale=3 * d**-0.5), rand(v, dtype=BF16)
    t = targets(m, v, 0.2, option.get("ignore_index", -100))
    kw = dict(option, recompute=recompute, chunk_vocab=8192)
    with _kernels.lm_head_grad_epilogue() as slices:
        before = launches()
        loss, grads = check(f"lce grad epilogue v={v} {option} recompute={recompute} seed={seed}", [x, w, b], t,
                            tokens=m, **kw)
        assert slices() > 0
        assert_ran(before, {"linear_ce_grad"}, "lm_head_grad_epilogue")
    dl = torch.randn(t.shape, device="cuda") if "reduction" in option else torch.tensor(1.7, device="cuda")
    with _kernels.lm_head_grad_epilogue():
        loss, grads = run(lambda x, w, b: ops.linear_cross_entropy(x, w, t, b, **kw), [x, w, b], dl)
    loss2, grads2 = run(lambda x, w, b: ops.linear_cross_entropy(x, w, t, b, **kw), [x, w, b], dl)
    torch.testing.assert_close(loss, loss2, rtol=0, atol=0)
    for g, g2 in zip(grads, grads2):
        assert rel_err(g, g2) < 5e-3


def test_grad_epilogue_is_off_by_default():
    m, v = 64, 5000
    x, w, t = rand(m, 256, dtype=BF16), rand(v, 256, dtype=BF16, scale=256**-0.5), targets(m, v)
    first = torch.ops.coda._lm_head_grad_epilogue_slices()
    run(lambda x, w: ops.linear_cross_entropy(x, w, t), [x, w], torch.tensor(1.0, device="cuda"))
    assert torch.ops.coda._lm_head_grad_epilogue_slices() == first


def test_one_read_is_off_by_default():
    m, v = 64, 5000
    x, w, t = rand(m, 256, dtype=BF16), rand(v, 256, dtype=BF16, scale=256**-0.5), targets(m, v)
    first = torch.ops.coda._cross_entropy_one_read_launches()
    run(lambda x, w: ops.linear_cross_entropy(x, w, t, recompute=False), [x, w], torch.tensor(1.0, device="cuda"))
    assert torch.ops.coda._cross_entropy_one_read_launches() == first


@pytest.mark.parametrize("v", [32000, 32003, 50257, 9])
@pytest.mark.parametrize("recompute", [False, "half"])
def test_forward_dw_is_rounded_into_its_own_bytes(v, recompute, seed):
    """recompute=False: dW's float32 head rows are rounded in place and its tail after them (coda::scale_round
    over log2 launches; "half": the recomputed rows written there), so the bf16 gradient is those bytes:
    contiguous, no other buffer kept, and the values
    those of scaling and rounding the float32 dW once (the three-GEMM path's, recompute=True within torch's
    error of float64 in test_gradients_in_the_forward)."""
    m, d = 300, 256
    x, w, t = rand(m, d, dtype=BF16), rand(v, d, dtype=BF16, scale=d**-0.5), targets(m, v, 0.1)
    xl, wl = leaves(x, w)
    ops.linear_cross_entropy(xl, wl, t, recompute=recompute).backward(torch.tensor(0.7, device="cuda"))
    g = wl.grad
    head = dw_head_rows(v)
    assert g.dtype == BF16 and g.shape == (v, d) and g.is_contiguous() and g.storage_offset() == 0
    assert g.untyped_storage().nbytes() == 4 * head * d
    x64, w64 = leaves(x.double(), w.double())
    (0.7 * F.cross_entropy(F.linear(x64, w64), t)).backward()
    xb, wb = leaves(x, w)
    (0.7 * F.cross_entropy(F.linear(xb, wb).float(), t)).backward()
    within_torch_error(f"lce in-place dW v={v} recompute={recompute} seed={seed}", rel_err(g, w64.grad),
                       rel_err(wb.grad, w64.grad), numel=v * d)


@pytest.mark.parametrize("m", [1, 300, 4097])
def test_recomputed_dx_is_rounded_into_its_own_bytes(m, seed):
    """recompute=True: dX's float32 sum over the slices is x's first half of rows and the rest, rounded into the
    first's bytes (coda::scale_round in place), so the bf16 gradient is that storage; values within torch's error."""
    d, v = 256, 32003
    x, w, t = rand(m, d, dtype=BF16), rand(v, d, dtype=BF16, scale=d**-0.5), targets(m, v, 0.1)
    xl = leaves(x)[0]
    ops.linear_cross_entropy(xl, w, t, chunk_vocab=4096).backward(torch.tensor(0.7, device="cuda"))
    g = xl.grad
    assert g.dtype == BF16 and g.shape == (m, d) and g.is_contiguous() and g.storage_offset() == 0
    assert g.untyped_storage().nbytes() == 4 * dw_head_rows(m) * d
    x64 = leaves(x.double())[0]
    (0.7 * F.cross_entropy(F.linear(x64, w.double()), t)).backward()
    xb = leaves(x)[0]
    (0.7 * F.cross_entropy(F.linear(xb, w).float(), t)).backward()
    within_torch_error(f"lce recomputed dX m={m} seed={seed}", rel_err(g, x64.grad), rel_err(xb.grad, x64.grad),
                       numel=m * d)


@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_gemms_leave_torchs_cublas_switch(recompute, seed):
    """The head's GEMMs reduce in float32 by their own handle's math mode: torch's process-wide switch for
    16-bit reductions is neither flipped nor read (bit-identical results under either setting)."""
    x, w = rand(1000, 1024, dtype=BF16), rand(50257, 1024, dtype=BF16, scale=1024**-0.5)
    t = targets(1000, 50257, 0.1)
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_bf16_reduced_precision_reduction
    results = []
    try:
        for allowed in (True, False):
            matmul.allow_bf16_reduced_precision_reduction = allowed
            xl, wl = leaves(x, w)
            loss = ops.linear_cross_entropy(xl, wl, t, recompute=recompute)
            loss.backward(torch.tensor(1.3, device="cuda"))
            assert matmul.allow_bf16_reduced_precision_reduction is allowed
            results.append((loss.detach(), xl.grad, wl.grad))
    finally:
        matmul.allow_bf16_reduced_precision_reduction = saved
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_op_check_and_compile(seed):
    x, w, t = rand(100, 256, dtype=BF16), rand(3001, 256, dtype=BF16, scale=256**-0.5), targets(100, 3001, 0.1)
    b = rand(3001, dtype=BF16)
    for red in (0, 1, 2):
        for recompute in (0, 1, 2):  # False, True, "half"
            torch.library.opcheck(torch.ops.coda.linear_cross_entropy_loss.default,
                                  (x, w, b, t, -100, 0.1, 0.0, 0.0, red, 32, recompute, 1000))
    lse = torch.logsumexp(F.linear(x, w, b).float(), -1)
    torch.library.opcheck(torch.ops.coda.linear_cross_entropy_backward.default,
                          (torch.tensor(0.3, device="cuda"), x, w, b, t, lse, -100, 0.1, 0.0, 0.0, 1000,
                           [True, True, True], 1500), test_utils=("test_schema", "test_faketensor"))
    for dw_tail in (True, False):
        torch.library.opcheck(torch.ops.coda.linear_cross_entropy.default,
                              (x, w, b, t, -100, 0.0, 20.0, 0.0, 1, 0, [True, True, True], dw_tail))
    for recompute in RECOMPUTE:
        xl, wl = leaves(x, w)
        torch._dynamo.reset()
        fn = torch.compile(lambda x, w: ops.linear_cross_entropy(x, w, t, label_smoothing=0.1, recompute=recompute),
                           fullgraph=True)
        fn(xl, wl).backward()
        xe, we = leaves(x, w)
        ops.linear_cross_entropy(xe, we, t, label_smoothing=0.1, recompute=recompute).backward()
        torch.testing.assert_close(xl.grad, xe.grad)
        torch.testing.assert_close(wl.grad, we.grad)
        torch._dynamo.reset()
