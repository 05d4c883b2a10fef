"""GPU tests of the LLaMA path: the gated MLP (norm_glu_mlp, glu_mlp)
and RMSNorm -> QKV -> RoPE (rmsnorm_linear_rope), forward and every gradient
against float64, each within the error of the unfused torch bf16 path (the ops'
*_reference) on the same fresh random inputs, outputs poisoned before each run,
in strict mode, with the launch counters showing that the LLaMA programs ran
(norm_glu_linear, glu_dgrad_rowdot, norm_rope_linear); opcheck of the four ops
and torch.compile(fullgraph=True) of the block. Skipped without an sm_90 GPU."""

import pytest
import torch
import torch.nn.functional as F

import coda
from coda import _activations, ops
from helpers import assert_ran, check_op, launches, poison_cuda_allocator, rel_err, within_torch_error
from test_gpu import check_against_torch, leaves, rand, strict  # noqa: F401  (strict: autouse)
from test_gpu_norm import norm_params, residual_stream, row_stats64

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
EPS = 1e-5
THETA = 500000.0  # LLaMA 3's


def check(name, fn, ref_fn, inputs, dy, out_bytes, programs):
    """check_against_torch, with each of `programs` launched on the way."""
    check_against_torch(name, fn, ref_fn, inputs, dy, out_bytes, programs=programs,
                        tokens=dy.reshape(-1, dy.shape[-1]).shape[0])


GLU = ("norm_glu_linear", "glu_dgrad_rowdot")
ROPE = ("norm_rope_linear", "norm_dgrad")  # the RoPE backward's dgrad applies the norm's backward


def glu_weights(d, f, e=None):
    """w_gate_up (2F, D), interleaved; w_down (E, F)."""
    e = e or d
    return rand(2 * f, d, dtype=BF16, scale=d**-0.5), rand(e, f, dtype=BF16, scale=f**-0.5)


def glu_bytes(m, d, f):
    return 2 * m * (8 * f + 4 * d)


# ---- the gated MLP

GLU_SHAPES = [(1000, 1024, 2816), (777, 2048, 1024), (1, 1024, 1024), (4096, 2048, 5632), (129, 512, 1536)]


@pytest.mark.parametrize("m,d,f", GLU_SHAPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_norm_glu_mlp_shapes(m, d, f, activation, seed):
    # LLaMA's post-attention half: x + MLP(RMSNorm(x)); every gradient (x, γ, W_gu, W_down)
    x, (g, _) = residual_stream(m, d), norm_params(d, False)
    w_gu, w_down = glu_weights(d, f)
    dy = rand(m, d, dtype=BF16)
    check(f"norm_glu_mlp {activation} {m}x{d}x{f} seed={seed}",
          lambda x, g, w1, w2: ops.norm_glu_mlp(x, g, None, w1, w2, "RMSNorm", EPS, activation, residual=x),
          lambda x, g, w1, w2: ops.norm_glu_mlp_reference(x, g, None, w1, w2, "RMSNorm", EPS, activation,
                                                          residual=x),
          [x, g, w_gu, w_down], dy, glu_bytes(m, d, f), GLU)


@pytest.mark.parametrize("residual", [None, "input", "other"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
def test_norm_glu_mlp_residuals(residual, activation, seed):
    # without a residual and with another tensor's, the down projection leaves D (E = 1536)
    m, d, f = 1000, 1024, 2816
    e = d if residual == "input" else 1536
    x, (g, _) = residual_stream(m, d), norm_params(d, False)
    w_gu, w_down = glu_weights(d, f, e)
    r = rand(m, e, dtype=BF16) if residual == "other" else None
    dy = rand(m, e, dtype=BF16)

    def res(x, r):
        return x if residual == "input" else r

    check(f"norm_glu_mlp {activation} residual={residual} seed={seed}",
          lambda x, g, w1, w2, r: ops.norm_glu_mlp(x, g, None, w1, w2, "RMSNorm", EPS, activation, res(x, r)),
          lambda x, g, w1, w2, r: ops.norm_glu_mlp_reference(x, g, None, w1, w2, "RMSNorm", EPS, activation,
                                                             res(x, r)),
          [x, g, w_gu, w_down, r], dy, glu_bytes(m, d, max(f, e)), GLU)


@pytest.mark.parametrize("m,d,f", [(1000, 1024, 2816), (777, 2048, 1024), (7, 512, 512)])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("residual", [None, "input"])
def test_glu_mlp(m, d, f, activation, residual, seed):
    # no norm in front: the gate/up GEMM reads x as it is
    x = rand(m, d, dtype=BF16)
    w_gu, w_down = glu_weights(d, f)
    dy = rand(m, d, dtype=BF16)

    def res(x):
        return x if residual == "input" else None

    check(f"glu_mlp {activation} {m}x{d}x{f} residual={residual} seed={seed}",
          lambda x, w1, w2: ops.glu_mlp(x, w1, w2, activation, res(x)),
          lambda x, w1, w2: ops.glu_mlp_reference(x, w1, w2, activation, res(x)),
          [x, w_gu, w_down], dy, glu_bytes(m, d, f), GLU)


def test_glu_mlp_leading_dims_inference(seed):
    x = rand(4, 250, 1024, dtype=BF16)
    g, _ = norm_params(1024, False)
    w_gu, w_down = glu_weights(1024, 2816)
    poison_cuda_allocator(glu_bytes(1000, 1024, 2816))
    before = launches()
    with torch.no_grad():
        y = ops.norm_glu_mlp(x, g, None, w_gu, w_down, "RMSNorm", EPS, residual=x)
    assert_ran(before, ("norm_glu_linear",), "norm_glu_mlp inference")
    assert y.shape == (4, 250, 1024)
    y64 = ops.norm_glu_mlp_reference(x.double(), g.double(), None, w_gu.double(), w_down.double(), "RMSNorm", EPS,
                                     residual=x.double())
    within_torch_error(f"norm_glu_mlp leading dims seed={seed}", rel_err(y, y64),
                       rel_err(ops.norm_glu_mlp_reference(x, g, None, w_gu, w_down, "RMSNorm", EPS, residual=x),
                               y64))


@pytest.mark.parametrize("residual", ["input", "other"])
def test_norm_glu_mlp_return_stats(residual, seed):
    # The next norm's row statistics from the down projection's epilogue: against
    # float64 statistics of the float64 output, within torch's error (fp32
    # statistics of its bf16 output), and those of the y it returned.
    m, d, f = 1000, 1024, 2816
    x, (g, _) = residual_stream(m, d), norm_params(d, False)
    w_gu, w_down = glu_weights(d, f)
    r = residual_stream(m, d) if residual == "other" else x
    poison_cuda_allocator(glu_bytes(m, d, f))
    before = launches()
    with torch.no_grad():
        y, stats = ops.norm_glu_mlp(x, g, None, w_gu, w_down, "RMSNorm", EPS, residual=r, return_stats=True)
    assert_ran(before, ("norm_glu_linear", "linear_residual_stats"), "norm_glu_mlp return_stats")
    assert stats.shape == (m, 2) and stats.dtype == torch.float32
    y64 = ops.norm_glu_mlp_reference(x.double(), g.double(), None, w_gu.double(), w_down.double(), "RMSNorm", EPS,
                                     residual=r.double())
    yt = ops.norm_glu_mlp_reference(x, g, None, w_gu, w_down, "RMSNorm", EPS, residual=r)
    within_torch_error(f"norm_glu_mlp return_stats y seed={seed}", rel_err(y, y64), rel_err(yt, y64))
    _, rstd64 = row_stats64(y64, False, EPS)
    _, rstd_t = row_stats64(yt.float(), False, EPS)
    within_torch_error(f"norm_glu_mlp return_stats rstd seed={seed}", rel_err(stats[:, 1], rstd64),
                       rel_err(rstd_t.float(), rstd64))
    _, rstd_y = row_stats64(y, False, EPS)
    assert rel_err(stats[:, 1], rstd_y) < 1e-5
    assert torch.equal(stats[:, 0], torch.zeros_like(stats[:, 0]))


def test_residual_reduce_feeds_norm_glu_mlp(seed):
    # o-proj + residual + RMSNorm statistics, then the MLP with them: the
    # LLaMA block's second half, against the unfused chain
    m, d, f = 1000, 1024, 2816
    a, w_o = rand(m, d, dtype=BF16), rand(d, d, dtype=BF16, scale=d**-0.5)
    r, (g, _) = residual_stream(m, d), norm_params(d, False)
    w_gu, w_down = glu_weights(d, f)
    dy = rand(m, d, dtype=BF16)

    def fused(a, w_o, r, g, w_gu, w_down):
        y, stats = ops.linear_residual(a, w_o, None, r, "RMSNorm", EPS)
        return ops.norm_glu_mlp(y, g, None, w_gu, w_down, "RMSNorm", EPS, residual=y, stats=stats)

    def unfused(a, w_o, r, g, w_gu, w_down):
        y = F.linear(a, w_o) + r
        return ops.norm_glu_mlp_reference(y, g, None, w_gu, w_down, "RMSNorm", EPS, residual=y)

    check(f"residual-reduce -> norm_glu_mlp seed={seed}", fused, unfused, [a, w_o, r, g, w_gu, w_down], dy,
          glu_bytes(m, d, f), ("linear_residual_stats",) + GLU)


# ---- RMSNorm -> QKV -> RoPE

def positions_of(kind, m, dtype=torch.int32):
    """"sequences": packed sequences of 300 tokens, rows shuffled; "long": any of 0..131071
    (LLaMA 3.1's context), 131071 among them."""
    if kind == "sequences":
        pos = (torch.arange(m) % 300)[torch.randperm(m)]
    else:
        pos = torch.randint(0, 131072, (m,))
        pos[m // 2] = 131071
    return pos.to("cuda", dtype)


def qkv_size(head_dim, heads, kv_heads):
    return (heads + 2 * kv_heads) * head_dim


ROPE_SHAPES = [  # m, d, head_dim, heads, kv_heads
    (1000, 1024, 128, 8, 2),
    (777, 2048, 64, 32, 8),  # LLaMA-3.2-1B's heads
    (4096, 1024, 64, 16, 16),  # no grouping
    (1, 512, 128, 4, 1),
    (129, 4096, 128, 32, 8),  # LLaMA-3-8B's
]


@pytest.mark.parametrize("m,d,head_dim,heads,kv_heads", ROPE_SHAPES)
@pytest.mark.parametrize("pos_kind", ["sequences", "long"])
def test_rmsnorm_linear_rope(m, d, head_dim, heads, kv_heads, pos_kind, seed):
    n = qkv_size(head_dim, heads, kv_heads)
    x, (g, _) = residual_stream(m, d), norm_params(d, False)
    w = rand(n, d, dtype=BF16, scale=d**-0.5)
    pos = positions_of(pos_kind, m)
    freq = ops.rope_frequencies(head_dim, heads, kv_heads, THETA, device="cuda")
    dy = rand(m, n, dtype=BF16)
    check(f"rmsnorm_linear_rope {m}x{d}x{n} hd={head_dim} {pos_kind} seed={seed}",
          lambda x, g, w: ops.rmsnorm_linear_rope(x, g, w, pos, freq, eps=EPS),
          lambda x, g, w: ops.rmsnorm_linear_rope_reference(x, g, w, pos, freq, eps=EPS),
          [x, g, w], dy, 8 * m * max(n, d) * 2, ROPE)


@pytest.mark.parametrize("theta", [10000.0, THETA])
def test_rmsnorm_linear_rope_bias_int64_positions(theta, seed):
    # a QKV bias (Qwen2's), rotated with the product; int64 positions; leading dims
    b, s, d, head_dim, heads, kv_heads = 3, 333, 1024, 128, 8, 2
    n = qkv_size(head_dim, heads, kv_heads)
    x, (g, _) = residual_stream(b * s, d).reshape(b, s, d), norm_params(d, False)
    w, bias = rand(n, d, dtype=BF16, scale=d**-0.5), rand(n, dtype=BF16)
    pos = positions_of("long", b * s, torch.int64).reshape(b, s)
    freq = ops.rope_frequencies(head_dim, heads, kv_heads, theta, device="cuda")
    dy = rand(b, s, n, dtype=BF16)
    check(f"rmsnorm_linear_rope bias theta={theta} seed={seed}",
          lambda x, g, w, bias: ops.rmsnorm_linear_rope(x, g, w, pos, freq, bias, EPS),
          lambda x, g, w, bias: ops.rmsnorm_linear_rope_reference(x, g, w, pos, freq, bias, EPS),
          [x, g, w, bias], dy, 8 * b * s * n * 2, ROPE)


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(128, 8, 2), (64, 32, 8)])
def test_residual_reduce_feeds_rmsnorm_linear_rope(head_dim, heads, kv_heads, seed):
    # the statistics from the o-proj of the layer before (linear_residual), as a
    # block stacks them, instead of a pass over x
    m, d = 1000, 2048
    n = qkv_size(head_dim, heads, kv_heads)
    a, w_o = rand(m, d, dtype=BF16), rand(d, d, dtype=BF16, scale=d**-0.5)
    r, (g, _) = residual_stream(m, d), norm_params(d, False)
    w = rand(n, d, dtype=BF16, scale=d**-0.5)
    pos = positions_of("long", m)
    freq = ops.rope_frequencies(head_dim, heads, kv_heads, THETA, device="cuda")
    dy = rand(m, n, dtype=BF16)

    def fused(a, w_o, r, g, w):
        y, stats = ops.linear_residual(a, w_o, None, r, "RMSNorm", EPS)
        return ops.rmsnorm_linear_rope(y, g, w, pos, freq, eps=EPS, stats=stats)

    def unfused(a, w_o, r, g, w):
        return ops.rmsnorm_linear_rope_reference(F.linear(a, w_o) + r, g, w, pos, freq, eps=EPS)

    check(f"residual-reduce -> rmsnorm_linear_rope hd={head_dim} seed={seed}", fused, unfused, [a, w_o, r, g, w], dy,
          8 * m * n * 2, ("linear_residual_stats",) + ROPE)


def test_mlp_stats_feed_the_next_layers_qkv(seed):
    # layer i's MLP returns the row statistics of its output, layer i + 1's
    # RMSNorm -> QKV -> RoPE takes them: the whole hand-over between layers
    m, d, f, head_dim, heads, kv_heads = 1000, 1024, 2816, 128, 8, 2
    n = qkv_size(head_dim, heads, kv_heads)
    x, (g2, _), (g1, _) = residual_stream(m, d), norm_params(d, False), norm_params(d, False)
    w_gu, w_down = glu_weights(d, f)
    w = rand(n, d, dtype=BF16, scale=d**-0.5)
    pos = positions_of("sequences", m)
    freq = ops.rope_frequencies(head_dim, heads, kv_heads, THETA, device="cuda")
    dy = rand(m, n, dtype=BF16)

    def fused(x, g2, w_gu, w_down, g1, w):
        z, stats = ops.norm_glu_mlp(x, g2, None, w_gu, w_down, "RMSNorm", EPS, residual=x, return_stats=True)
        return ops.rmsnorm_linear_rope(z, g1, w, pos, freq, eps=EPS, stats=stats)

    def unfused(x, g2, w_gu, w_down, g1, w):
        z = ops.norm_glu_mlp_reference(x, g2, None, w_gu, w_down, "RMSNorm", EPS, residual=x)
        return ops.rmsnorm_linear_rope_reference(z, g1, w, pos, freq, eps=EPS)

    check(f"norm_glu_mlp stats -> rmsnorm_linear_rope seed={seed}", fused, unfused, [x, g2, w_gu, w_down, g1, w], dy,
          glu_bytes(m, d, f), GLU + ROPE + ("linear_residual_stats",))


def _rotate_half(t):
    half = t.shape[-1] // 2
    return torch.cat((-t[..., half:], t[..., :half]), -1)


def test_rope_matches_hugging_face_rotate_half(seed):
    # A rotate-half checkpoint's weight, pair-permuted, through the op, and its
    # output unpermuted: Hugging Face's apply_rotary_pos_emb of its QKV
    # projection, computed here in float64 (angles included).
    m, d, head_dim, heads, kv_heads = 1000, 1024, 128, 8, 2
    n, q, kv = qkv_size(head_dim, heads, kv_heads), heads * head_dim, kv_heads * head_dim
    x, (g, _) = residual_stream(m, d), norm_params(d, False)
    w_hf = rand(n, d, dtype=BF16, scale=d**-0.5)
    pos = positions_of("long", m)
    freq = ops.rope_frequencies(head_dim, heads, kv_heads, THETA, device="cuda")
    w = ops.rope_permute_qk(w_hf, head_dim, heads, kv_heads)
    with torch.no_grad():
        y = ops.rope_unpermute_qk(ops.rmsnorm_linear_rope(x, g, w, pos, freq, eps=EPS), head_dim, heads, kv_heads,
                                  dim=-1)
        yt = ops.rope_unpermute_qk(ops.rmsnorm_linear_rope_reference(x, g, w, pos, freq, eps=EPS), head_dim, heads,
                                   kv_heads, dim=-1)
    h = F.linear(F.rms_norm(x.double(), (d,), g.double(), EPS), w_hf.double())
    inv_freq = THETA ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device="cuda") / head_dim)
    angles = pos.double()[:, None] * inv_freq
    cos, sin = torch.cat((angles, angles), -1).cos()[:, None], torch.cat((angles, angles), -1).sin()[:, None]
    hq, hk, hv = h.split([q, kv, kv], -1)
    rot = [(t.unflatten(-1, (-1, head_dim)) * cos + _rotate_half(t.unflatten(-1, (-1, head_dim))) * sin).flatten(1)
           for t in (hq, hk)]
    want = torch.cat([*rot, hv], -1)
    within_torch_error(f"rmsnorm_linear_rope vs HF rotate-half seed={seed}", rel_err(y, want), rel_err(yt, want))


# ---- the block, as coda.bench composes it

def test_llama_block_forward_backward(seed):
    # RMSNorm -> QKV -> RoPE; o-proj + residual + statistics; RMSNorm -> SwiGLU
    # MLP + residual: both outputs (concatenated) and every gradient
    m, d, f, head_dim, heads, kv_heads = 1000, 2048, 5632, 64, 32, 8
    n = qkv_size(head_dim, heads, kv_heads)
    x, (g1, _), (g2, _) = residual_stream(m, d), norm_params(d, False), norm_params(d, False)
    attn, w_o = rand(m, heads * head_dim, dtype=BF16), rand(d, heads * head_dim, dtype=BF16, scale=d**-0.5)
    w_qkv = rand(n, d, dtype=BF16, scale=d**-0.5)
    w_gu, w_down = glu_weights(d, f)
    pos = positions_of("sequences", m)
    freq = ops.rope_frequencies(head_dim, heads, kv_heads, THETA, device="cuda")
    dy = rand(m, n + d, dtype=BF16)

    def fused(x, attn, g1, w_qkv, w_o, g2, w_gu, w_down):
        qkv = ops.rmsnorm_linear_rope(x, g1, w_qkv, pos, freq, eps=EPS)
        y, stats = ops.linear_residual(attn, w_o, None, x, "RMSNorm", EPS)
        return torch.cat([qkv, ops.norm_glu_mlp(y, g2, None, w_gu, w_down, "RMSNorm", EPS, residual=y, stats=stats)],
                         -1)

    def unfused(x, attn, g1, w_qkv, w_o, g2, w_gu, w_down):
        qkv = ops.rmsnorm_linear_rope_reference(x, g1, w_qkv, pos, freq, eps=EPS)
        y = F.linear(attn, w_o) + x
        return torch.cat([qkv, ops.norm_glu_mlp_reference(y, g2, None, w_gu, w_down, "RMSNorm", EPS, residual=y)], -1)

    check(f"llama block seed={seed}", fused, unfused, [x, attn, g1, w_qkv, w_o, g2, w_gu, w_down], dy,
          glu_bytes(m, d, f), GLU + ROPE + ("linear_residual_stats",))


def test_llama_block_compiles_fullgraph_inductor(seed):
    torch._dynamo.reset()
    m, d, f, head_dim, heads, kv_heads = 1024, 1024, 2816, 128, 8, 2
    n = qkv_size(head_dim, heads, kv_heads)
    pos = positions_of("sequences", m).reshape(2, 512)
    freq = ops.rope_frequencies(head_dim, heads, kv_heads, THETA, device="cuda")

    def block(x, attn, g1, w_qkv, w_o, g2, w_gu, w_down):
        qkv = ops.rmsnorm_linear_rope(x, g1, w_qkv, pos, freq, eps=EPS)
        y, stats = ops.linear_residual(attn, w_o, None, x, "RMSNorm", EPS)
        z, z_stats = ops.norm_glu_mlp(y, g2, None, w_gu, w_down, "RMSNorm", EPS, residual=y, stats=stats,
                                      return_stats=True)
        return qkv, ops.glu_mlp(z, w_gu, w_down, "gelu_tanh", residual=z), z_stats

    inputs = [residual_stream(m, d).reshape(2, 512, d), rand(2, 512, d, dtype=BF16), norm_params(d, False)[0],
              rand(n, d, dtype=BF16, scale=d**-0.5), rand(d, d, dtype=BF16, scale=d**-0.5), norm_params(d, False)[0],
              *glu_weights(d, f)]
    compiled = torch.compile(block, fullgraph=True)
    xs = leaves(*inputs)
    before = launches()
    qkv, z, st = compiled(*xs)
    (qkv.float().square().mean() + z.float().square().mean()).backward()
    assert_ran(before, GLU + ROPE + ("linear_residual_stats",), "compiled llama block")
    assert qkv.shape == (2, 512, n) and z.shape == (2, 512, d) and st.shape == (2, 512, 2)
    grads = [t.grad.clone() for t in xs[:2]]
    es = leaves(*inputs)
    qkv_e, z_e, st_e = block(*es)
    (qkv_e.float().square().mean() + z_e.float().square().mean()).backward()
    assert rel_err(qkv, qkv_e) < 1e-6 and rel_err(z, z_e) < 1e-6 and rel_err(st, st_e) < 1e-6
    for g, e in zip(grads, es[:2]):  # dx, dattn: per-row sums, the same order either way
        assert rel_err(g, e.grad) < 1e-6


def test_swiglu_module_compiles_fullgraph_inductor(seed):
    torch._dynamo.reset()
    mlp = coda.nn.SwiGLUMLP(1024, 2816, normalization="RMSNorm", eps=EPS, device="cuda", dtype=BF16)
    compiled = torch.compile(mlp, fullgraph=True)
    x = residual_stream(2048, 1024).reshape(4, 512, 1024).requires_grad_(True)
    before = launches()
    y = compiled(x, residual=x)
    y.float().square().mean().backward()
    assert_ran(before, GLU, "compiled SwiGLUMLP")
    g = x.grad.clone()
    x.grad = None
    y_eager = mlp(x, residual=x)
    y_eager.float().square().mean().backward()
    assert rel_err(y, y_eager) < 1e-6 and rel_err(g, x.grad) < 1e-6


# ---- the ops themselves

def test_llama_opcheck_on_gpu():
    m, d, f = 64, 256, 512
    x, (g, _) = residual_stream(m, d), norm_params(d, False)
    w_gu, w_down = glu_weights(d, f)
    r, dy = rand(m, d, dtype=BF16), rand(m, d, dtype=BF16)
    stats = torch.ops.coda.row_stats(x, False, EPS)
    silu, gelu_tanh = _activations.code("silu"), _activations.code("gelu_tanh")
    glu, glu_bwd = torch.ops.coda.norm_glu_mlp.default, torch.ops.coda.norm_glu_mlp_backward.default
    for st in (None, stats):
        check_op(glu, (x, g, w_gu, w_down, st, None, True, EPS, silu, True, True))
        check_op(glu, (x, g, w_gu, w_down, st, r, False, EPS, gelu_tanh, False, False))
    check_op(glu, (x, None, w_gu, w_down, None, None, False, 0.0, silu, True, False))  # glu_mlp: no norm
    _, h, a, st_used, _ = glu(x, g, w_gu, w_down, None, None, True, EPS, silu, True, False)
    check_op(glu_bwd, (dy, x, g, w_gu, w_down, h, a, st_used, True, silu, [True, True, True, True]))
    check_op(glu_bwd, (dy, x, g, w_gu, w_down, h, a, st_used, False, silu, [False, True, False, True]))
    _, h, a, _, _ = glu(x, None, w_gu, w_down, None, None, False, 0.0, silu, True, False)
    check_op(glu_bwd, (dy, x, None, w_gu, w_down, h, a, None, False, silu, [True, False, True, True]))

    head_dim, heads, kv_heads = 64, 2, 1
    n = qkv_size(head_dim, heads, kv_heads)
    w, bias = rand(n, d, dtype=BF16, scale=d**-0.5), rand(n, dtype=BF16)
    pos = positions_of("long", m)
    freq = ops.rope_frequencies(head_dim, heads, kv_heads, THETA, device="cuda")
    rope, rope_bwd = torch.ops.coda.rmsnorm_linear_rope.default, torch.ops.coda.rmsnorm_linear_rope_backward.default
    for st in (None, stats):
        for b in (None, bias):
            check_op(rope, (x, g, w, b, pos, freq, st, EPS))
    y, st_used, shift = rope(x, g, w, bias, pos, freq, None, EPS)
    dy_n = rand(m, n, dtype=BF16)
    check_op(rope_bwd, (dy_n, x, g, w, y, pos, freq, st_used, shift, [True, True, True, True]))
    check_op(rope_bwd, (dy_n, x, g, w, y, pos, freq, st_used, shift, [True, False, False, False]))


def test_llama_ops_take_no_fills_in_backward():
    # A fill kernel in a backward is a zero gradient materialized for an output
    # nobody differentiates (h, a, the statistics): none here either.
    from torch.profiler import ProfilerActivity, profile
    m, d, f, head_dim, heads, kv_heads = 512, 1024, 2816, 128, 8, 2
    x, (g, _) = residual_stream(m, d), norm_params(d, False)
    w_gu, w_down = glu_weights(d, f)
    w = rand(qkv_size(head_dim, heads, kv_heads), d, dtype=BF16, scale=d**-0.5)
    pos = positions_of("sequences", m)
    freq = ops.rope_frequencies(head_dim, heads, kv_heads, THETA, device="cuda")
    fns = {"norm_glu_mlp": lambda x, g, w1, w2: ops.norm_glu_mlp(x, g, None, w1, w2, "RMSNorm", EPS, residual=x),
           "rmsnorm_linear_rope": lambda x, g, w1, w2: ops.rmsnorm_linear_rope(x, g, w, pos, freq, eps=EPS)}
    for name, fn in fns.items():
        xs = leaves(x, g, w_gu, w_down)
        out = fn(*xs)
        dy = torch.randn_like(out)
        out.backward(dy)  # warm up
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(*xs).backward(dy)
            torch.cuda.synchronize()
        fills = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                 and "FillFunctor" in e.name]
        assert not fills, f"{name}: {fills}"


# ---- Qwen3's / Gemma 3's per-head RMSNorm + RoPE (head_norm_rope): q and k as the QKV output holds them

def head_inputs(m, heads, kv_heads, head_dim, dtype=BF16, theta=1e6):
    """q, a strided view of a (m, (heads + 2 kv_heads)·head_dim) QKV output, its norm weight in pair
    order, positions and inv_freq."""
    y = rand(m, qkv_size(head_dim, heads, kv_heads), dtype=dtype)
    q = y[:, :heads * head_dim].unflatten(-1, (heads, head_dim))
    weight = (1 + 0.2 * torch.randn(head_dim, device="cuda")).to(dtype)
    half = head_dim // 2
    inv_freq = (theta ** (-torch.arange(half, dtype=torch.float64) / half)).to("cuda", torch.float32)
    return q, weight, inv_freq


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(128, 16, 8), (64, 32, 8), (256, 4, 1)])
@pytest.mark.parametrize("pos_kind", ["sequences", "long"])
def test_head_norm_rope(head_dim, heads, kv_heads, pos_kind, seed):
    m, eps = 1000, 1e-6
    q, weight, inv_freq = head_inputs(m, heads, kv_heads, head_dim)
    pos = positions_of(pos_kind, m)
    dy = rand(m, heads, head_dim, dtype=BF16)
    check(f"head_norm_rope hd={head_dim} heads={heads} {pos_kind} seed={seed}",
          lambda q, w: ops.head_norm_rope(q, w, pos, inv_freq, eps),
          lambda q, w: ops.head_norm_rope_reference(q, w, pos, inv_freq, eps),
          [q, weight], dy, 4 * m * heads * head_dim * 2, ())


def test_head_norm_rope_fp16_leading_dims_and_op(seed):
    b, s, heads, head_dim, eps = 2, 300, 8, 128, 1e-6
    q, weight, inv_freq = head_inputs(b * s, heads, 2, head_dim, dtype=torch.float16)
    q = q.unflatten(0, (b, s))
    pos = torch.arange(s, device="cuda").expand(b, s)  # int64, HF's position_ids
    dy = rand(b, s, heads, head_dim, dtype=torch.float16)
    check(f"head_norm_rope fp16 seed={seed}", lambda q, w: ops.head_norm_rope(q, w, pos, inv_freq, eps),
          lambda q, w: ops.head_norm_rope_reference(q, w, pos, inv_freq, eps), [q, weight], dy,
          4 * b * s * heads * head_dim * 2, ())
    check_op(torch.ops.coda.head_norm_rope.default, (q.detach().requires_grad_(True), weight, pos, inv_freq, eps))


def test_head_norm_rope_falls_back_visibly_for_other_head_dims():
    q, weight, inv_freq = head_inputs(64, 4, 1, 96)  # Phi-3's head_dim has no kernel here
    pos = torch.arange(64, device="cuda")
    coda.set_strict(False)
    try:
        with pytest.warns(coda.FallbackWarning, match="head_dim 96"):
            out = ops.head_norm_rope(q, weight, pos, inv_freq, 1e-6)
    finally:
        coda.set_strict(True)
    assert torch.equal(out, ops.head_norm_rope_reference(q, weight, pos, inv_freq, 1e-6))
