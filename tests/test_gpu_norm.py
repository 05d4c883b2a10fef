"""GPU tests of the norm-folding ops: LayerNorm/RMSNorm folded into the GEMM
after it, residual-reduce, and the fused LayerNormMLP, forward and every
gradient against float64, each within the error of the unfused torch bf16
path on the same fresh random inputs (rows with |mean| up to 10x their std),
outputs poisoned before each run. Skipped without an sm_90 GPU."""

import pytest
import torch
import torch.nn.functional as F

import coda
from coda import _activations, reference
from helpers import poison_cuda_allocator, rel_err, within_torch_error
from test_gpu import check_against_torch, rand
from test_norm_cpu import opcheck_norm_ops

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16


def residual_stream(m, d, offset=10.0, dtype=BF16):
    """Rows of std 1 whose means spread uniformly over ±offset std, as residual streams drift."""
    mean = (torch.rand(m, 1, device="cuda") * 2 - 1) * offset
    return (mean + torch.randn(m, d, device="cuda")).to(dtype)


def norm_params(d, layernorm, dtype=BF16):
    gamma = (1 + 0.2 * torch.randn(d, device="cuda")).to(dtype)
    beta = (0.2 * torch.randn(d, device="cuda")).to(dtype) if layernorm else None
    return gamma, beta


SHAPES = [(1000, 1032, 3000), (7, 256, 512), (1, 512, 1024), (4096, 1024, 3072)]


@pytest.mark.parametrize("m,d,n", SHAPES)
@pytest.mark.parametrize("layernorm", [True, False])
@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
def test_norm_linear(m, d, n, layernorm, activation, seed):
    x = residual_stream(m, d)
    g, b = norm_params(d, layernorm)
    w, bias = rand(n, d, dtype=BF16, scale=d**-0.5), rand(n, dtype=BF16)
    dy = rand(m, n, dtype=BF16)
    eps = 1e-5 if layernorm else 1e-6

    def fused(x, g, b, w, bias):
        if layernorm:
            return coda.ops.layernorm_linear(x, g, b, w, bias, eps, activation)
        return coda.ops.rmsnorm_linear(x, g, w, bias, eps, activation)

    def unfused(x, g, b, w, bias):
        return reference.norm_linear_ref(x, g, b, w, bias, layernorm, eps, activation)

    assert coda._kernels.norm_usable([x, g, b, w, bias], [d, n])
    check_against_torch(f"norm_linear ln={layernorm} {activation} {m}x{d}x{n} seed={seed}", fused, unfused,
                        [x, g, b, w, bias], dy, 8 * m * max(n, d) * 2)


@pytest.mark.parametrize("layernorm", [True, False])
@pytest.mark.parametrize("activation,residual", [("gelu_tanh", "input"), ("silu", "other"), (None, None)])
def test_norm_mlp(layernorm, activation, residual, seed):
    m, d, f = 1000, 1032, 3000
    x = residual_stream(m, d)
    g, b = norm_params(d, layernorm)
    w1, b1 = rand(f, d, dtype=BF16, scale=d**-0.5), rand(f, dtype=BF16)
    w2, b2 = rand(d, f, dtype=BF16, scale=f**-0.5), rand(d, dtype=BF16)
    r = rand(m, d, dtype=BF16) if residual == "other" else None
    dy = rand(m, d, dtype=BF16)
    kind = "LayerNorm" if layernorm else "RMSNorm"

    def res(x, r):
        return x if residual == "input" else r

    def fused(x, g, b, w1, b1, w2, b2, r):
        return coda.ops.norm_mlp(x, g, b, w1, b1, w2, b2, kind, 1e-5, activation, res(x, r))

    def unfused(x, g, b, w1, b1, w2, b2, r):
        return reference.norm_mlp_ref(x, g, b, w1, b1, w2, b2, layernorm, 1e-5, activation, res(x, r))

    check_against_torch(f"norm_mlp ln={layernorm} {activation} residual={residual} seed={seed}", fused, unfused,
                        [x, g, b, w1, b1, w2, b2, r], dy, 10 * m * f * 2)


@pytest.mark.parametrize("m,k,n", [(1000, 1032, 3000), (7, 512, 1024), (4096, 4096, 4096)])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_linear_residual(m, k, n, normalization, seed):
    x, w, bias = rand(m, k, dtype=BF16), rand(n, k, dtype=BF16, scale=k**-0.5), rand(n, dtype=BF16)
    r = residual_stream(m, n)
    dy = rand(m, n, dtype=BF16)
    check_against_torch(f"linear_residual {normalization} seed={seed}",
                        lambda x, w, b, r: coda.ops.linear_residual(x, w, b, r, normalization)[0],
                        lambda x, w, b, r: F.linear(x, w, b) + r, [x, w, bias, r], dy, 6 * m * n * 2)
    # The statistics: against float64 stats of the float64 output, each within
    # the error of torch's (fp32 stats of the bf16 output).
    layernorm = normalization == "LayerNorm"
    poison_cuda_allocator(4 * m * n * 2)
    with torch.no_grad():
        y, stats = coda.ops.linear_residual(x, w, bias, r, normalization)
    y64 = F.linear(x.double(), w.double(), bias.double()) + r.double()
    mean64, rstd64 = reference.row_stats_in(y64, layernorm, 1e-5, torch.float64)
    y_t = F.linear(x, w, bias) + r
    mean_t, rstd_t = reference.row_stats(y_t, layernorm, 1e-5)
    if m >= 1000:  # over a handful of rows the ratio of two rounding errors is noise
        within_torch_error(f"linear_residual rstd {normalization} seed={seed}", rel_err(stats[:, 1], rstd64),
                           rel_err(rstd_t, rstd64))
        if layernorm:
            within_torch_error(f"linear_residual mean {normalization} seed={seed}", rel_err(stats[:, 0], mean64),
                               rel_err(mean_t, mean64))
    # and they are the statistics of the Y it returned, to fp32 rounding
    mean_y, rstd_y = reference.row_stats_in(y, layernorm, 1e-5, torch.float64)
    assert rel_err(stats[:, 1], rstd_y) < 1e-5
    if layernorm:
        assert (stats[:, 0].double() - mean_y).abs().max().item() < 1e-5 * (1 + mean_y.abs().max().item())


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_residual_reduce_feeds_the_norm_gemm(normalization, seed):
    # o-proj + residual + stats, then the next norm-GEMM with those stats: the
    # pre-norm block's two halves, against the unfused chain.
    m, d, n = 1000, 1024, 3072
    layernorm = normalization == "LayerNorm"
    a, w_o, b_o = rand(m, d, dtype=BF16), rand(d, d, dtype=BF16, scale=d**-0.5), rand(d, dtype=BF16)
    r = residual_stream(m, d)
    g, b = norm_params(d, layernorm)
    w, bias = rand(n, d, dtype=BF16, scale=d**-0.5), rand(n, dtype=BF16)
    dy = rand(m, n, dtype=BF16)

    def fused(a, w_o, b_o, r, g, b, w, bias):
        y, stats = coda.ops.linear_residual(a, w_o, b_o, r, normalization)
        if layernorm:
            return coda.ops.layernorm_linear(y, g, b, w, bias, stats=stats)
        return coda.ops.rmsnorm_linear(y, g, w, bias, eps=1e-5, stats=stats)

    def unfused(a, w_o, b_o, r, g, b, w, bias):
        return reference.norm_linear_ref(F.linear(a, w_o, b_o) + r, g, b, w, bias, layernorm, 1e-5)

    check_against_torch(f"residual-reduce -> norm_linear {normalization} seed={seed}", fused, unfused,
                        [a, w_o, b_o, r, g, b, w, bias], dy, 8 * m * n * 2)


def test_constant_rows_and_tiny_eps(seed):
    # A constant row normalizes to 0 (rstd = 1/sqrt(eps) times 0): the output is β·Wᵀ + b.
    # The fold would compute rstd·(x·W̃ᵀ − mean·s), two sums of the same terms in
    # different orders, times 1/sqrt(eps) = 10⁶: such rows must get x̂ = 0 exactly.
    m, d, n = 64, 256, 512
    x = torch.full((m, d), 3.0, device="cuda", dtype=BF16)
    g, b = norm_params(d, True)
    w, bias = rand(n, d, dtype=BF16, scale=d**-0.5), rand(n, dtype=BF16)
    for eps in (1e-5, 1e-12):
        y = coda.ops.layernorm_linear(x, g, b, w, bias, eps=eps)
        assert torch.isfinite(y.float()).all()
        ref = F.linear(b.double(), w.double(), bias.double()).expand(m, -1)
        assert rel_err(y, ref) < 1e-2, (eps, seed)


def test_fp16_takes_the_reference_path(seed):
    m, d, n = 64, 256, 512
    x = residual_stream(m, d, dtype=torch.float16)
    g, b = norm_params(d, True, torch.float16)
    w = rand(n, d, dtype=torch.float16, scale=d**-0.5)
    assert not coda._kernels.norm_usable([x, g, b, w], [d, n])
    dy = rand(m, n, dtype=torch.float16)
    check_against_torch(f"layernorm_linear fp16 seed={seed}",
                        lambda x, g, b, w: coda.ops.layernorm_linear(x, g, b, w),
                        lambda x, g, b, w: reference.norm_linear_ref(x, g, b, w), [x, g, b, w], dy, 1 << 22)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_norm_mlp_module_compiles_fullgraph_inductor(normalization, seed):
    torch._dynamo.reset()
    mlp = coda.nn.LayerNormMLP(1024, 4096, normalization=normalization, device="cuda", dtype=BF16)
    compiled = torch.compile(mlp, fullgraph=True)
    x = residual_stream(2048, 1024).reshape(4, 512, 1024).requires_grad_(True)
    y = compiled(x, residual=x)
    y.float().square().mean().backward()
    g = x.grad.clone()
    x.grad = None
    y_eager = mlp(x, residual=x)
    y_eager.float().square().mean().backward()
    assert rel_err(y, y_eager) < 1e-6 and rel_err(g, x.grad) < 1e-6


def test_norm_opcheck_on_gpu():
    m, d, n = 64, 256, 512
    x = residual_stream(m, d).requires_grad_(True)
    g, b = norm_params(d, True)
    w, bias = rand(n, d, dtype=BF16), rand(n, dtype=BF16)
    torch.library.opcheck(torch.ops.coda.norm_linear.default, (x, g, b, w, bias, None, None, [], True, 1e-5, 1, True))
    w2 = rand(d, n, dtype=BF16)
    torch.library.opcheck(torch.ops.coda.norm_mlp.default,
                          (x, g, None, w, bias, w2, None, None, None, [], None, True, False, 1e-6, 4, True))
    r = rand(m, n, dtype=BF16)
    torch.library.opcheck(torch.ops.coda.linear_residual.default, (x, w, bias, r, True, 1e-5))
    xd = x.detach()
    torch.library.opcheck(torch.ops.coda.norm_row_stats.default, (xd, True, 1e-5))
    torch.library.opcheck(torch.ops.coda.norm_fold_weight.default, (w, g, b, bias, True))
    mean, rstd = torch.ops.coda.norm_row_stats(xd, True, 1e-5)
    _, s, t = torch.ops.coda.norm_fold_weight(w, g, b, bias, False)
    torch.library.opcheck(torch.ops.coda.gemm_norm_linear.default, (xd, w, mean, rstd, s, t, 1, True))
    torch.library.opcheck(torch.ops.coda.gemm_linear_residual.default, (xd, w, bias, r, True, 1e-5))
    h = rand(m, n, dtype=BF16)
    torch.library.opcheck(torch.ops.coda.norm_row_dots.default, (r, h, 1, t, s, 1.0 / d, True))
    c1, c2 = mean.clone(), rstd.clone()
    torch.library.opcheck(torch.ops.coda.gemm_norm_dgrad.default,
                          (r, w, xd, mean, rstd, g, b, c1, c2, xd, True, True))
    torch.library.opcheck(torch.ops.coda.gemm_dgrad_rowdot.default, (xd, w2, h, 1, True, t, s, 1.0 / d))


def test_norm_dgrad_epilogue_alone(seed):
    # dX, N̂, dγ, dβ of the norm_dgrad kernel against the formulas in float64.
    m, d, n = 1000, 1032, 3000
    x = residual_stream(m, d)
    g, b = norm_params(d, True)
    w, dp, dr = rand(n, d, dtype=BF16, scale=n**-0.5), rand(m, n, dtype=BF16), rand(m, d, dtype=BF16)
    mean, rstd = torch.ops.coda.norm_row_stats(x, True, 1e-5)
    c1, c2 = torch.randn(m, device="cuda"), torch.randn(m, device="cuda")
    poison_cuda_allocator(6 * m * d * 2)
    dx, nhat, dg, db = torch.ops.coda.gemm_norm_dgrad(dp, w, x, mean, rstd, g, b, c1, c2, dr, True, True)
    acc = dp.double() @ w.double()
    xhat = (x.double() - mean.double()[:, None]) * rstd.double()[:, None]
    want_dx = rstd.double()[:, None] * (g.double() * acc - xhat * c1.double()[:, None] - c2.double()[:, None]) \
        + dr.double()
    bf16_rounding = 2.0**-8
    assert rel_err(dx, want_dx) < bf16_rounding, seed
    assert rel_err(nhat, xhat * g.double() + b.double()) < bf16_rounding, seed
    assert rel_err(dg, (acc * xhat).sum(0)) < bf16_rounding, seed
    assert rel_err(db, acc.sum(0)) < bf16_rounding, seed


@pytest.mark.parametrize("m,n", [(1000, 3000), (1, 8), (4096, 12288)])
@pytest.mark.parametrize("activation", [0, 1])
def test_row_dots_pass_alone(m, n, activation, seed):
    # dP, c1, c2 and the bias gradient of a lone norm-linear's backward, in one
    # pass: tiles of 128 rows x 256 columns, so the shapes leave partial ones.
    dy, h = rand(m, n, dtype=BF16), rand(m, n, dtype=BF16)
    t, s = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    scale = 1.0 / 777
    poison_cuda_allocator(4 * m * n * 2)
    dp, c1, c2, db = torch.ops.coda.norm_row_dots(dy, h, activation, t, s, scale, True)
    if activation == 0:
        want_dp = dy.double()
        assert dp.numel() == 0
    else:
        want_dp = dy.double() * _activations.grad(h.double(), _activations.GELU_TANH)
        assert rel_err(dp, want_dp) < 2.0**-8, seed
        want_dp = dp.double()  # the reductions are taken of the rounded dP the GEMMs read
    assert rel_err(c1, scale * (want_dp * (h.double() - t.double())).sum(1)) < 1e-5, seed
    assert rel_err(c2, scale * (want_dp * s.double()).sum(1)) < 1e-5, seed
    assert rel_err(db, want_dp.sum(0)) < 2.0**-8, seed
    # without the bias gradient another kernel runs (one block per row)
    dp2, c1_only, c2_none, db_none = torch.ops.coda.norm_row_dots(dy, h, activation, t, None, scale, False)
    assert rel_err(c1_only, scale * (want_dp * (h.double() - t.double())).sum(1)) < 1e-5, seed
    assert c2_none.numel() == 0 and db_none.numel() == 0
    if activation != 0:
        assert torch.equal(dp2, dp)


def test_fold_cache_sees_weight_updates(seed):
    # Inference reuses the folded weight; an in-place update (as optimizers make) must refold.
    m, d, n = 256, 512, 1024
    x = residual_stream(m, d)
    g, b = norm_params(d, True)
    w, bias = rand(n, d, dtype=BF16, scale=d**-0.5), rand(n, dtype=BF16)
    with torch.no_grad():
        first = coda.ops.layernorm_linear(x, g, b, w, bias)
        assert torch.equal(coda.ops.layernorm_linear(x, g, b, w, bias), first)
        w.mul_(-1)
        g.add_(0.5)
        after = coda.ops.layernorm_linear(x, g, b, w, bias)
    ref = reference.norm_linear_ref(x.double(), g.double(), b.double(), w.double(), bias.double())
    unfused = reference.norm_linear_ref(x, g, b, w, bias)
    within_torch_error(f"fold cache after update seed={seed}", rel_err(after, ref), rel_err(unfused, ref))


@pytest.mark.parametrize("d", [256, 4096, 4104, 12288])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_row_stats_pass(d, normalization, seed):
    # The one-pass statistics for a first layer: rows longer than the 4096
    # elements it keeps in registers are read a second time.
    x = residual_stream(333, d)
    layernorm = normalization == "LayerNorm"
    poison_cuda_allocator(1 << 20)
    stats = coda.ops.row_stats(x, normalization, 1e-5)
    mean64, rstd64 = reference.row_stats_in(x, layernorm, 1e-5, torch.float64)
    assert rel_err(stats[:, 1], rstd64) < 1e-5, seed
    if layernorm:
        assert rel_err(stats[:, 0], mean64) < 1e-5, seed


@pytest.mark.parametrize("layernorm", [True, False])
def test_opcheck_norm_ops_on_gpu(layernorm):
    assert coda._kernels.norm_usable([torch.empty(64, 256, device="cuda", dtype=BF16)], [256, 384])
    opcheck_norm_ops(layernorm, "cuda", BF16, m=64, d=256, n=384)
