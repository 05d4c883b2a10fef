"""GPU tests of the norm-folding ops: LayerNorm/RMSNorm folded into the GEMM
after it, residual-reduce, and the fused LayerNormMLP, forward and every
gradient against float64, each within the error of the unfused torch bf16
path on the same fresh random inputs (rows with |mean| up to 10x their std),
outputs poisoned before each run, in strict mode. Skipped without an sm_90
GPU."""

import pytest
import torch
import torch.nn.functional as F

import coda
from coda import ops
from helpers import assert_ran, check_op, launches, poison_cuda_allocator, rel_err, within_torch_error
from test_gpu import check_against_torch, leaves, rand, strict  # noqa: F401  (strict: autouse)

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


def row_stats64(y, layernorm, eps=1e-5):
    y = y.double()
    if layernorm:
        var, mean = torch.var_mean(y, -1, correction=0)
        return mean, torch.rsqrt(var + eps)
    return None, torch.rsqrt(y.square().mean(-1) + eps)


# The programs each op launches (csrc/kernels/table.def): a norm-GEMM's backward runs the norm's
# dgrad in the dX GEMM's epilogue; the norm-MLP's fc2 dgrad carries act' and the norm's row dots.
NORM_LINEAR = ("norm_linear_act", "norm_dgrad")
NORM_MLP = ("norm_linear_act", "linear_act", "dact_rowdot", "norm_dgrad")

SHAPES = [(1000, 1032, 3000), (7, 256, 512), (1, 512, 1024), (4096, 1024, 3072), (129, 512, 384)]


@pytest.mark.parametrize("m,d,n", SHAPES)
@pytest.mark.parametrize("layernorm", [True, False])
@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
def test_norm_linear(m, d, n, layernorm, activation, seed):
    x = residual_stream(m, d)
    g, b = norm_params(d, layernorm)
    w, bias = rand(n, d, dtype=BF16, scale=d**-0.5), rand(n, dtype=BF16)
    dy = rand(m, n, dtype=BF16)
    eps = 1e-5 if layernorm else 1e-6
    kind = "LayerNorm" if layernorm else "RMSNorm"

    def fused(x, g, b, w, bias):
        if layernorm:
            return ops.layernorm_linear(x, g, b, w, bias, eps, activation)
        return ops.rmsnorm_linear(x, g, w, bias, eps, activation)

    def unfused(x, g, b, w, bias):
        return ops.norm_linear_reference(x, g, b, w, bias, kind, eps, activation)

    check_against_torch(f"norm_linear {kind} {activation} {m}x{d}x{n} seed={seed}", fused, unfused,
                        [x, g, b, w, bias], dy, 8 * m * max(n, d) * 2, programs=NORM_LINEAR)


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
        return ops.norm_mlp(x, g, b, w1, b1, w2, b2, kind, 1e-5, activation, res(x, r))

    def unfused(x, g, b, w1, b1, w2, b2, r):
        return ops.norm_mlp_reference(x, g, b, w1, b1, w2, b2, kind, 1e-5, activation, res(x, r))

    check_against_torch(f"norm_mlp {kind} {activation} residual={residual} seed={seed}", fused, unfused,
                        [x, g, b, w1, b1, w2, b2, r], dy, 10 * m * f * 2, programs=NORM_MLP)


@pytest.mark.parametrize("m,k,n", [(1000, 1032, 3000), (7, 512, 1024), (4096, 4096, 4096)])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_linear_residual(m, k, n, normalization, seed):
    x, w, bias = rand(m, k, dtype=BF16), rand(n, k, dtype=BF16, scale=k**-0.5), rand(n, dtype=BF16)
    r = residual_stream(m, n)
    dy = rand(m, n, dtype=BF16)
    check_against_torch(f"linear_residual {normalization} seed={seed}",
                        lambda x, w, b, r: ops.linear_residual(x, w, b, r, normalization, eps=1e-5)[0],
                        lambda x, w, b, r: F.linear(x, w, b) + r, [x, w, bias, r], dy, 6 * m * n * 2,
                        programs=("linear_residual_stats",))
    # The statistics: against float64 stats of the float64 output, each within
    # the error of torch's (fp32 stats of the bf16 output).
    layernorm = normalization == "LayerNorm"
    poison_cuda_allocator(4 * m * n * 2)
    with torch.no_grad():
        y, stats = ops.linear_residual(x, w, bias, r, normalization, eps=1e-5)
    mean64, rstd64 = row_stats64(F.linear(x.double(), w.double(), bias.double()) + r.double(), layernorm)
    mean_t, rstd_t = row_stats64((F.linear(x, w, bias) + r).float(), layernorm)
    if m >= 1000:  # over a handful of rows the ratio of two rounding errors is noise
        within_torch_error(f"linear_residual rstd {normalization} seed={seed}", rel_err(stats[:, 1], rstd64),
                           rel_err(rstd_t.float(), rstd64))
        if layernorm:
            within_torch_error(f"linear_residual mean {normalization} seed={seed}", rel_err(stats[:, 0], mean64),
                               rel_err(mean_t.float(), mean64))
    # and they are the statistics of the Y it returned, to fp32 rounding
    mean_y, rstd_y = row_stats64(y, layernorm)
    assert rel_err(stats[:, 1], rstd_y) < 1e-5
    if layernorm:
        assert (stats[:, 0].double() - mean_y).abs().max().item() < 1e-5 * (1 + mean_y.abs().max().item())
    else:
        assert torch.equal(stats[:, 0], torch.zeros_like(stats[:, 0]))


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
        y, stats = ops.linear_residual(a, w_o, b_o, r, normalization, eps=1e-5)
        if layernorm:
            return ops.layernorm_linear(y, g, b, w, bias, stats=stats)
        return ops.rmsnorm_linear(y, g, w, bias, eps=1e-5, stats=stats)

    def unfused(a, w_o, b_o, r, g, b, w, bias):
        return ops.norm_linear_reference(F.linear(a, w_o, b_o) + r, g, b, w, bias, normalization, 1e-5)

    check_against_torch(f"residual-reduce -> norm_linear {normalization} seed={seed}", fused, unfused,
                        [a, w_o, b_o, r, g, b, w, bias], dy, 8 * m * n * 2,
                        programs=("linear_residual_stats",) + NORM_LINEAR)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_norm_mlp_stats_feed_the_next_norm_gemm(normalization, seed):
    # GPT-2's chain: the MLP's fc2 writes the residual stream and the next
    # block's ln_1 statistics, which its norm-GEMM takes; against the unfused
    # chain, and the statistics against float64 within torch's error.
    m, d, f, n = 1000, 1024, 3072, 3072
    layernorm = normalization == "LayerNorm"
    x = residual_stream(m, d)
    g2, b2n = norm_params(d, layernorm)
    w1, b1 = rand(f, d, dtype=BF16, scale=d**-0.5), rand(f, dtype=BF16)
    w2, b2 = rand(d, f, dtype=BF16, scale=f**-0.5), rand(d, dtype=BF16)
    g1, b1n = norm_params(d, layernorm)
    w, bias = rand(n, d, dtype=BF16, scale=d**-0.5), rand(n, dtype=BF16)
    dy = rand(m, n, dtype=BF16)

    def fused(x, g2, b2n, w1, b1, w2, b2, g1, b1n, w, bias):
        h, stats = ops.norm_mlp(x, g2, b2n, w1, b1, w2, b2, normalization, 1e-5, "gelu_tanh", x, return_stats=True)
        if layernorm:
            return ops.layernorm_linear(h, g1, b1n, w, bias, 1e-5, stats=stats)
        return ops.rmsnorm_linear(h, g1, w, bias, eps=1e-5, stats=stats)

    def unfused(x, g2, b2n, w1, b1, w2, b2, g1, b1n, w, bias):
        h = ops.norm_mlp_reference(x, g2, b2n, w1, b1, w2, b2, normalization, 1e-5, "gelu_tanh", x)
        return ops.norm_linear_reference(h, g1, b1n, w, bias, normalization, 1e-5)

    check_against_torch(f"norm_mlp stats -> norm_linear {normalization} seed={seed}", fused, unfused,
                        [x, g2, b2n, w1, b1, w2, b2, g1, b1n, w, bias], dy, 10 * m * f * 2,
                        programs=("linear_residual_stats", "dact_rowdot") + NORM_LINEAR)
    poison_cuda_allocator(4 * m * f * 2)
    before = launches()
    with torch.no_grad():
        y, stats = ops.norm_mlp(x, g2, b2n, w1, b1, w2, b2, normalization, 1e-5, "gelu_tanh", x, return_stats=True)
    assert_ran(before, ("norm_linear_act", "linear_residual_stats"), "norm_mlp return_stats")
    mean_y, rstd_y = row_stats64(y, layernorm)  # the statistics of the y it returned, to fp32 rounding
    assert rel_err(stats[:, 1], rstd_y) < 1e-5
    if layernorm:
        assert (stats[:, 0].double() - mean_y).abs().max().item() < 1e-5 * (1 + mean_y.abs().max().item())
    else:
        assert torch.equal(stats[:, 0], torch.zeros_like(stats[:, 0]))


def test_constant_rows_and_tiny_eps(seed):
    # A constant row normalizes to 0: the output is β·Wᵀ + b. The fold would
    # compute rstd·(x·W̃ᵀ − mean·s), two sums of the same terms in different
    # orders, times 1/sqrt(eps) = 10⁶: the epilogue gives such rows H = t.
    m, d, n = 64, 256, 512
    x = torch.full((m, d), 3.0, device="cuda", dtype=BF16)
    g, b = norm_params(d, True)
    w, bias = rand(n, d, dtype=BF16, scale=d**-0.5), rand(n, dtype=BF16)
    for eps in (1e-5, 1e-12):
        y = ops.layernorm_linear(x, g, b, w, bias, eps=eps)
        assert torch.isfinite(y.float()).all()
        ref = F.linear(b.double(), w.double(), bias.double()).expand(m, -1)
        assert rel_err(y, ref) < 1e-2, (eps, seed)


def test_fp16_takes_the_reference_path(seed):
    coda.set_strict(False)
    m, d, n = 64, 256, 512
    x = residual_stream(m, d, dtype=torch.float16)
    g, b = norm_params(d, True, torch.float16)
    w = rand(n, d, dtype=torch.float16, scale=d**-0.5)
    with pytest.warns(coda.FallbackWarning, match="dtype float16 has no kernel"):
        y = ops.layernorm_linear(x, g, b, w)
    assert rel_err(y, ops.norm_linear_reference(x.double(), g.double(), b.double(), w.double())) < 1e-2


@pytest.mark.parametrize("m", [1000, 129, 4099])
def test_dgamma_over_partial_tiles_with_poisoned_neighbours(m, seed):
    # M % 128 != 0: the last tile's rows past M hold no data. Every input sits
    # inside NaN-filled memory, every output comes from a poisoned allocator;
    # dγ and dβ (sums over M in the epilogue) must not see a NaN.
    d, n = 512, 768

    def padded(t):
        flat = torch.full((t.numel() + 2048,), float("nan"), device="cuda", dtype=t.dtype)
        flat[1024:1024 + t.numel()] = t.reshape(-1)
        return flat[1024:1024 + t.numel()].view(t.shape)

    x, (g, b) = padded(residual_stream(m, d)), (padded(t) for t in norm_params(d, True))
    w, bias = padded(rand(n, d, dtype=BF16, scale=d**-0.5)), padded(rand(n, dtype=BF16))
    dy = padded(rand(m, n, dtype=BF16))
    check_against_torch(f"layernorm_linear dγ m={m} seed={seed}",
                        lambda x, g, b, w, bias: ops.layernorm_linear(x, g, b, w, bias, activation="gelu_tanh"),
                        lambda x, g, b, w, bias: ops.norm_linear_reference(x, g, b, w, bias, "LayerNorm", 1e-5,
                                                                           "gelu_tanh"),
                        [x, g, b, w, bias], dy, 8 * m * n * 2, programs=NORM_LINEAR)


def test_row_dots_beyond_65535_strips(seed):
    # The bias gradient's pass tiles rows in strips of 64 along grid.y (at most
    # 65535): 4.2 M rows and more loop over them.
    # d = n = 128: with 16 features the fold's rounding of W∘γ (16 terms per
    # output) alone moved the bias gradient's error 1.0-1.6x torch's by seed.
    m, d, n = 65535 * 64 + 200, 128, 128
    x, (g, b) = residual_stream(m, d, offset=1.0), norm_params(d, True)
    w, bias = rand(n, d, dtype=BF16, scale=d**-0.5), rand(n, dtype=BF16)
    xs = leaves(x, g, b, w, bias)
    dy = rand(m, n, dtype=BF16)
    ops.layernorm_linear(*xs, activation="gelu_tanh").backward(dy)
    ts = leaves(x, g, b, w, bias)
    ops.norm_linear_reference(*ts, activation="gelu_tanh").backward(dy)
    t64 = [t.detach().double().requires_grad_(True) for t in (x, g, b, w, bias)]
    ops.norm_linear_reference(*t64, activation="gelu_tanh").backward(dy.double())
    for i in (0, 4):  # dx and the bias gradient; the latter's error is an estimate over n = 128
        # elements (1.105x torch's on one draw at 956e967): the slack grows with 1/sqrt(n)
        within_torch_error(f"{m} rows grad[{i}] seed={seed}", rel_err(xs[i].grad, t64[i].grad),
                           rel_err(ts[i].grad, t64[i].grad), numel=n if i == 4 else 0)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_norm_mlp_module_compiles_fullgraph_inductor(normalization, seed):
    torch._dynamo.reset()
    mlp = coda.nn.LayerNormMLP(1024, 4096, normalization=normalization, device="cuda", dtype=BF16)
    compiled = torch.compile(mlp, fullgraph=True)
    x = residual_stream(2048, 1024).reshape(4, 512, 1024).requires_grad_(True)
    before = launches()
    y = compiled(x, residual=x)
    y.float().square().mean().backward()
    assert_ran(before, NORM_MLP, "compiled LayerNormMLP")
    g = x.grad.clone()
    x.grad = None
    y_eager = mlp(x, residual=x)
    y_eager.float().square().mean().backward()
    assert rel_err(y, y_eager) < 1e-6 and rel_err(g, x.grad) < 1e-6


@pytest.mark.parametrize("layernorm", [True, False])
def test_norm_opcheck_on_gpu(layernorm):
    m, d, n = 64, 256, 512
    x = residual_stream(m, d)
    g, b = norm_params(d, layernorm)
    w, bias, w2 = rand(n, d, dtype=BF16), rand(n, dtype=BF16), rand(d, n, dtype=BF16)
    stats = torch.ops.coda.row_stats(x, layernorm, 1e-5)
    fw, s, t = torch.ops.coda.fold_norm_weight(w, g, b, bias, layernorm)
    s = s if layernorm else None
    check_op(torch.ops.coda.row_stats.default, (x, layernorm, 1e-5))
    check_op(torch.ops.coda.fold_norm_weight.default, (w, g, b, bias, layernorm))
    for st in (None, stats):
        for fold in ((None, None, None), (fw, s, t)):
            check_op(torch.ops.coda.norm_linear.default, (x, g, b, w, bias, st, *fold, layernorm, 1e-5, 1, True))
            check_op(torch.ops.coda.norm_mlp.default, (x, g, b, w, bias, w2, None, st, *fold, None, True, layernorm,
                                                       1e-5, 4, True, st is not None))
    dy, h = rand(m, n, dtype=BF16), rand(m, n, dtype=BF16)
    check_op(torch.ops.coda.norm_linear_backward.default,
             (dy, x, g, b, w, h, stats, s, t, layernorm, 1, [True, True, layernorm, True, True]))
    check_op(torch.ops.coda.norm_mlp_backward.default,
             (rand(m, d, dtype=BF16), x, g, b, w, w2, h, h.clone(), stats, s, t, True, layernorm, 1,
              [True, True, layernorm, True, True, True, True]))
    check_op(torch.ops.coda.linear_residual.default, (x, rand(d, d, dtype=BF16), None, x.clone(), layernorm, 1e-5))


@pytest.mark.parametrize("d", [256, 4096, 4104, 12288])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_row_stats_pass(d, normalization, seed):
    # The one-pass statistics for a first layer: rows longer than the 4096
    # elements it keeps in registers are read a second time.
    x = residual_stream(333, d)
    layernorm = normalization == "LayerNorm"
    poison_cuda_allocator(1 << 20)
    stats = ops.row_stats(x, normalization, 1e-5)
    mean64, rstd64 = row_stats64(x, layernorm)
    assert rel_err(stats[:, 1], rstd64) < 1e-5, seed
    if layernorm:
        assert rel_err(stats[:, 0], mean64) < 1e-5, seed


# ---- the fold a module keeps for inference

def test_kept_fold_gives_the_same_output(seed):
    m = coda.nn.LayerNormMLP(1024, 4096, device="cuda", dtype=BF16)
    x = residual_stream(512, 1024)
    with torch.no_grad():
        fresh = m(x, residual=x)
        m.fold_weights()
        assert m.folded_for(x) is m._fold.folded
        kept = m(x, residual=x)
    assert torch.equal(fresh, kept)
    assert m.folded_for(x) is None  # with grad on, the forward folds afresh


def test_kept_fold_under_a_cuda_graph_follows_load_state_dict(seed):
    m = coda.nn.LayerNormLinear(1024, 3072, device="cuda", dtype=BF16).fold_weights()
    x = residual_stream(256, 1024)
    with torch.no_grad():
        m(x)  # warm up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = m(x)
        other = coda.nn.LayerNormLinear(1024, 3072, device="cuda", dtype=BF16)
        m.load_state_dict(other.state_dict())
        graph.replay()
        torch.cuda.synchronize()
        want = other(x)
    assert rel_err(y, want) < 1e-6, seed


def test_kept_fold_with_inference_mode_parameters(seed):
    with torch.inference_mode():
        m = coda.nn.LayerNormLinear(1024, 3072, device="cuda", dtype=BF16).fold_weights()
        x = residual_stream(256, 1024)
        y = m(x)
        want = ops.norm_linear_reference(x.double(), m.norm.weight.double(), m.norm.bias.double(),
                                         m.linear.weight.double(), m.linear.bias.double())
    assert rel_err(y, want) < 1e-2, seed


# ---- Gemma's sandwich norms: residual + RMSNorm(x)·γ in one pass (rmsnorm_residual)

@pytest.mark.parametrize("d", [1152, 2048, 16384])  # 16384: dγ's 64 KB of shared memory takes the opt-in
@pytest.mark.parametrize("zero_centered", [True, False])
def test_rmsnorm_residual(d, zero_centered, seed):
    m, eps = 1000, 1e-6
    x, r = rand(m, d, dtype=BF16, scale=3.0), residual_stream(m, d)
    w = (0.2 * torch.randn(d, device="cuda")).to(BF16) + (0 if zero_centered else 1)
    dy = rand(m, d, dtype=BF16)
    check_against_torch(f"rmsnorm_residual d={d} zero_centered={zero_centered} seed={seed}",
                        lambda x, w, r: ops.rmsnorm_residual(x, w, r, eps, zero_centered),
                        lambda x, w, r: ops.rmsnorm_residual_reference(x, w, r, eps, zero_centered),
                        [x, w, r], dy, 6 * m * d * 2, programs=(), tokens=m)


def test_rmsnorm_residual_fp16_strided_and_op(seed):
    b, s, d, eps = 2, 300, 1152, 1e-6
    big = rand(b, s, 2 * d, dtype=torch.float16)
    x = big[..., :d]  # a strided view, as a split GEMM output would be
    r, w = rand(b, s, d, dtype=torch.float16), (0.2 * torch.randn(d, device="cuda")).to(torch.float16)
    dy = rand(b, s, d, dtype=torch.float16)
    check_against_torch(f"rmsnorm_residual fp16 seed={seed}", lambda x, w, r: ops.rmsnorm_residual(x, w, r, eps, True),
                        lambda x, w, r: ops.rmsnorm_residual_reference(x, w, r, eps, True), [x, w, r], dy,
                        6 * b * s * d * 2, programs=(), tokens=b * s)
    check_op(torch.ops.coda.rmsnorm_residual.default, (x.detach().requires_grad_(True), w, r, eps, True))
