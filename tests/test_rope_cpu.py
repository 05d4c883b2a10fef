"""RMSNorm -> QKV -> RoPE on the CPU: the layout helpers (the q/k pair
permutation, the float-float frequencies), the reference path against Hugging
Face's LlamaRotaryEmbedding + apply_rotary_pos_emb (built from configs, no
downloads; skipped without transformers) and against float64 formulas, long
positions, the module RMSNormQKVRoPE with HF's state_dict, the argument errors,
and the kernel-path call against the spec's schema of coda::rmsnorm_linear_rope
(a CPU stand-in for the op)."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import compiled_once, cpu_stand_in, rms_stats_rows

import coda
from coda import _kernels, ops
from coda.ops import rope

EPS = 1e-6


def _rand(*shape, seed=0, dtype=torch.float64, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype) * scale


def _packed_positions(lengths, seed=0):
    """Packed sequences (each 0..len-1, concatenated), then shuffled: any order."""
    pos = torch.cat([torch.arange(n) for n in lengths])
    return pos[torch.randperm(len(pos), generator=torch.Generator().manual_seed(seed))]


def _inv_freq64(head_dim, theta):
    return theta ** (-2.0 * torch.arange(head_dim // 2, dtype=torch.float64) / head_dim)


def _rope_formula(h, positions, head_dim, n_heads, n_kv_heads, inv_freq):
    """Adjacent pairs (2i, 2i + 1) of each q and k head rotated by pos·inv_freq_i
    as a complex product, all in float64; v as it is."""
    nq, nk = n_heads * head_dim, n_kv_heads * head_dim
    rot = h[..., :nq + nk].double().unflatten(-1, (-1, head_dim // 2, 2))
    phi = positions.double()[..., None, None] * inv_freq.double()
    out = torch.view_as_real(torch.view_as_complex(rot.contiguous()) * torch.polar(torch.ones_like(phi), phi))
    return torch.cat([out.flatten(-3), h[..., nq + nk:].double()], -1)


# ---- layout helpers

def test_permute_layout_and_round_trip():
    # one q head and one kv head of 4 dims: rotate-half pairs (0, 2), (1, 3) become adjacent
    t = torch.arange(12.0)
    assert ops.rope_permute_qk(t, 4, 1, 1).tolist() == [0, 2, 1, 3, 4, 6, 5, 7, 8, 9, 10, 11]
    w = _rand(6 * 16 + 2 * 2 * 16, 24)  # 6 q heads, 2 kv heads, head_dim 16
    p = ops.rope_permute_qk(w, 16, 6, 2)
    assert p.is_contiguous() and not torch.equal(p, w)
    assert torch.equal(ops.rope_unpermute_qk(p, 16, 6, 2), w)
    assert torch.equal(p[8 * 16:], w[8 * 16:])  # v untouched
    assert torch.equal(p[2 * 16 + 2 * 5 + 1], w[2 * 16 + 5 + 8])  # head 2, pair 5, second member
    y = _rand(2, 3, 160)  # activations: dim=-1
    assert torch.equal(ops.rope_unpermute_qk(ops.rope_permute_qk(y, 16, 6, 2, dim=-1), 16, 6, 2, dim=-1), y)
    assert torch.equal(ops.rope_permute_qk(y, 16, 6, 2, dim=-1), ops.rope_permute_qk(y.mT, 16, 6, 2, dim=-2).mT)
    assert torch.equal(ops.rope_permute_qk(w[:, 0], 16, 6, 2), p[:, 0])  # a bias like a weight's rows


@pytest.mark.parametrize("head_dim,theta", [(64, 10000.0), (128, 500000.0)])
def test_frequencies_layout(head_dim, theta):
    nh, nkv = 4, 2
    freq = ops.rope_frequencies(head_dim, nh, nkv, theta)
    assert freq.dtype == torch.float32 and freq.shape == ((nh + 2 * nkv) * head_dim,)
    assert torch.equal(freq[(nh + nkv) * head_dim:], torch.zeros(nkv * head_dim))  # v: rotation by 0
    heads = freq[:(nh + nkv) * head_dim].view(nh + nkv, head_dim)
    assert torch.equal(heads, heads[:1].expand_as(heads))  # every q and k head the same pattern
    hi, lo = heads[0, 0::2].double(), heads[0, 1::2].double()
    turns = _inv_freq64(head_dim, theta) / (2 * math.pi)
    assert torch.equal(heads[0, 0::2], turns.float())  # hi = fp32(τ)
    assert torch.equal(heads[0, 1::2], (turns - hi).float())  # lo = fp32(τ − hi)
    # hi + lo is τ to float64 precision: |τ − hi − lo| ≤ |lo|·2^-24 ≤ τ·2^-48
    assert ((hi + lo - turns).abs() <= turns * 2.0**-47).all()
    # inv_freq given (scaled variants) takes the place of θ^(−2i/hd)
    scaled = _inv_freq64(head_dim, theta) / 8
    torch.testing.assert_close(ops.rope_frequencies(head_dim, nh, nkv, inv_freq=scaled.float())[:head_dim:2].double(),
                               scaled / (2 * math.pi), rtol=1e-7, atol=0)


# ---- the reference against Hugging Face

def _hf_config(transformers, d, heads, kv_heads, head_dim, rope, bias=False):
    return transformers.LlamaConfig(hidden_size=d, intermediate_size=2 * d, num_attention_heads=heads,
                                    num_key_value_heads=kv_heads, head_dim=head_dim, rope_parameters=rope,
                                    attention_bias=bias, rms_norm_eps=EPS, num_hidden_layers=1, vocab_size=128,
                                    max_position_embeddings=4096)


def _hf_qkv(hf, x, positions):
    """Hugging Face's LlamaDecoderLayer up to attention: RMSNorm -> q, k, v projections -> RoPE,
    as (batch, seq, heads, head_dim)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn, norm, rotary = hf
    n = norm(x)
    shape = (*x.shape[:-1], -1, attn.head_dim)
    q, k, v = (p(n).view(shape).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    cos, sin = rotary(n, positions)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _hf_modules(transformers, d, heads, kv_heads, head_dim, rope, bias=False):
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRMSNorm, LlamaRotaryEmbedding

    torch.manual_seed(0)
    cfg = _hf_config(transformers, d, heads, kv_heads, head_dim, rope, bias)
    attn, norm = LlamaAttention(cfg, 0).double(), LlamaRMSNorm(d, eps=EPS).double()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(d))
        for p in (attn.q_proj, attn.k_proj, attn.v_proj):
            if p.bias is not None:
                p.bias.normal_()
    return attn, norm, LlamaRotaryEmbedding(cfg)


def _hf_tolerance(q_pre, max_pos):
    """HF computes the angle as fp32(pos)·fp32(inv_freq) in float32 and cos/sin in
    float32: the angle is off by up to |φ|·2^-24 ≤ max_pos·2^-24 (inv_freq ≤ 1),
    cos and sin by 2^-24 more, so a rotated pair by up to (|x0| + |x1|) times
    that: atol = 2·max|x|·(max_pos + 2)·2^-24. And LlamaRMSNorm normalizes in
    float32 whatever the dtype: rtol a few fp32 ulps (2e-6)."""
    return dict(rtol=2e-6, atol=2 * q_pre.abs().max().item() * (max_pos + 2) * 2.0**-24)


V_TOL = dict(rtol=2e-6, atol=1e-6)  # v: only LlamaRMSNorm's float32 normalization


ROPES = {"default": {"rope_type": "default", "rope_theta": 10000.0},
         "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}}


@pytest.mark.parametrize("rope_kind", list(ROPES))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_reference_matches_hugging_face(head_dim, rope_kind):
    transformers = pytest.importorskip("transformers")
    heads, kv_heads, d = 4, 2, 96  # GQA; d is not heads·head_dim, as head_dim= allows
    attn, norm, rotary = hf = _hf_modules(transformers, d, heads, kv_heads, head_dim, ROPES[rope_kind])
    positions = _packed_positions([700, 300, 1000, 48])  # packed sequences, shuffled; up to 999
    x = _rand(1, len(positions), d)
    q_hf, k_hf, v_hf = _hf_qkv(hf, x, positions[None])

    w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
    # HF's own inv_freq (float32, llama3-scaled where so configured), as the module's inv_freq= takes it
    freq = ops.rope_frequencies(head_dim, heads, kv_heads, inv_freq=rotary.inv_freq)
    y = ops.rmsnorm_linear_rope_reference(x, norm.weight.detach(), ops.rope_permute_qk(w, head_dim, heads, kv_heads),
                                          positions[None], freq, eps=EPS)
    y = ops.rope_unpermute_qk(y, head_dim, heads, kv_heads, dim=-1)
    q, k, v = y.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    tol = _hf_tolerance(F.linear(norm(x), w), positions.max().item())
    torch.testing.assert_close(q.unflatten(-1, (heads, head_dim)), q_hf, **tol)
    torch.testing.assert_close(k.unflatten(-1, (kv_heads, head_dim)), k_hf, **tol)
    torch.testing.assert_close(v.unflatten(-1, (kv_heads, head_dim)), v_hf, **V_TOL)


def test_adjacent_pairs_match_the_complex_formula():
    # GPT-J / Meta convention: no permutation, pairs (2i, 2i + 1) are the complex numbers rotated
    hd, nh, nkv, d = 32, 4, 2, 48
    x, g, w, b = _rand(2, 9, d), 1 + 0.2 * _rand(d, seed=1), _rand(256, d, seed=2), _rand(256, seed=3)
    pos = _packed_positions([10, 8], seed=4).view(2, 9)
    y = ops.rmsnorm_linear_rope_reference(x, g, w, pos, ops.rope_frequencies(hd, nh, nkv, 10000.0), b, EPS)
    h = F.linear(F.rms_norm(x, (d,), g, EPS), w, b)
    torch.testing.assert_close(y, _rope_formula(h, pos, hd, nh, nkv, _inv_freq64(hd, 10000.0)), rtol=0, atol=1e-12)
    # position 0 rotates nothing
    y0 = ops.rmsnorm_linear_rope_reference(x, g, w, torch.zeros(2, 9, dtype=torch.int64),
                                           ops.rope_frequencies(hd, nh, nkv), b, EPS)
    torch.testing.assert_close(y0, h, rtol=0, atol=1e-15)


def test_long_positions_against_float64():
    # θ = 500000, head_dim 128, positions up to 131072 (LLaMA-3's context). The reference's angle is
    # 2π·pos·(hi + lo) reduced mod 1 turn in float64; hi + lo is τ to |Δτ| ≤ τ·2^-48, so the angle is off
    # by at most pos·inv_freq·2^-48 ≤ 131072·2^-48 = 4.7e-10 rad (inv_freq ≤ 1), plus float64 rounding of
    # a reduced angle (< 1e-15): each output by at most 2·max|h|·4.7e-10, which is the tolerance (× 2).
    hd, nh, nkv, d = 128, 2, 1, 64
    pos = torch.cat([torch.arange(131072 - 64, 131073), torch.randint(0, 131073, (191,),
                                                                          generator=torch.Generator().manual_seed(0))])
    x, g, w = _rand(len(pos), d), 1 + 0.2 * _rand(d, seed=1), _rand(512, d, seed=2, scale=d**-0.5)
    freq = ops.rope_frequencies(hd, nh, nkv, 500000.0)
    h = F.linear(F.rms_norm(x, (d,), g, EPS), w)
    want = _rope_formula(h, pos, hd, nh, nkv, _inv_freq64(hd, 500000.0))
    bound = 2 * h.abs().max().item() * 131072 * 2.0**-48
    y = ops.rmsnorm_linear_rope_reference(x, g, w, pos, freq, eps=EPS)
    assert (y - want).abs().max().item() <= 2 * bound
    # float32 activations: the same float64 rotation of float32 h, rounded once to float32
    y32 = ops.rmsnorm_linear_rope_reference(x.float(), g.float(), w.float(), pos.int(), freq, eps=EPS)
    h32 = F.linear(F.rms_norm(x.float(), (d,), g.float(), EPS), w.float())
    want32 = _rope_formula(h32.double(), pos, hd, nh, nkv, _inv_freq64(hd, 500000.0))
    torch.testing.assert_close(y32.double(), want32, rtol=2.0**-24, atol=2 * bound)
    # the tolerance means something: angles as fp32(pos)·fp32(inv_freq), HF's way, miss it by far
    inv32 = _inv_freq64(hd, 500000.0).float()
    hf_like = _rope_formula(h, torch.zeros_like(pos), hd, nh, nkv, inv32.double())  # unrotated layout
    phi32 = (pos.float()[:, None] * inv32).double()
    pairs = hf_like[:, :(nh + nkv) * hd].unflatten(-1, (-1, hd // 2, 2))
    c, s = phi32.cos()[:, None], phi32.sin()[:, None]
    rot = torch.stack([pairs[..., 0] * c - pairs[..., 1] * s, pairs[..., 0] * s + pairs[..., 1] * c], -1)
    assert (rot.flatten(-3) - want[:, :(nh + nkv) * hd]).abs().max().item() > 1e4 * bound


def test_stats_and_gradients():
    hd, nh, nkv, d = 16, 2, 1, 32
    x, g, w, b = _rand(3, 4, d), 1 + 0.2 * _rand(d, seed=1), _rand(64, d, seed=2), _rand(64, seed=3)
    pos, freq = torch.arange(12).view(3, 4), ops.rope_frequencies(hd, nh, nkv)
    st = ops.row_stats(x, "RMSNorm", EPS)
    torch.testing.assert_close(ops.rmsnorm_linear_rope(x, g, w, pos, freq, b, EPS, st),
                               ops.rmsnorm_linear_rope(x, g, w, pos, freq, b, EPS), rtol=1e-5, atol=1e-6)
    leaves = [t.clone().requires_grad_() for t in (x, g, w, b)]
    ops.rmsnorm_linear_rope(leaves[0], leaves[1], leaves[2], pos.int(), freq, leaves[3], EPS).square().sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in leaves)
    # the rotation is orthogonal: the squared norm, and so its gradient in x, is RoPE's-free
    gx = torch.autograd.grad(F.linear(F.rms_norm(x.requires_grad_(), (d,), g, EPS), w, b).square().sum(), x)[0]
    torch.testing.assert_close(leaves[0].grad, gx)


def test_autocast_computes_in_the_autocast_dtype():
    hd, nh, nkv, d = 16, 2, 1, 32
    x, g, w = _rand(3, d, dtype=torch.float32), torch.ones(d), _rand(64, d, seed=2, dtype=torch.float32)
    w.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ops.rmsnorm_linear_rope(x, g, w, torch.arange(3), ops.rope_frequencies(hd, nh, nkv))
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert w.grad.dtype == torch.float32


# ---- the module

@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_module_matches_hugging_face(head_dim, bias):
    transformers = pytest.importorskip("transformers")
    heads, kv_heads, d = 4, 2, 128
    attn, norm, rotary = hf = _hf_modules(transformers, d, heads, kv_heads, head_dim, ROPES["default"], bias)
    m = coda.nn.RMSNormQKVRoPE(d, heads, kv_heads, head_dim, rope_theta=10000.0, eps=EPS, bias=bias,
                               dtype=torch.float64)
    sd = {k: v for k, v in attn.state_dict().items() if not k.startswith("o_proj")}
    m.load_state_dict({**sd, "norm.weight": norm.weight})  # strict
    positions = _packed_positions([40, 24]).view(2, 32)
    x = _rand(2, 32, d)
    q_hf, k_hf, v_hf = _hf_qkv(hf, x, positions)
    q, k, v = m(x, positions, hf_order=True)
    assert q.shape == (2, 32, heads, head_dim) and k.shape == v.shape == (2, 32, kv_heads, head_dim)
    # HF's default inv_freq is θ^(−2i/hd) rounded to fp32 (a few ulps): angle off by max_pos·inv·~2^-22 more
    tol = _hf_tolerance(F.linear(norm(x), attn.q_proj.weight), 40)
    tol["atol"] *= 4
    torch.testing.assert_close(q, q_hf, **tol)
    torch.testing.assert_close(k, k_hf, **tol)
    torch.testing.assert_close(v, v_hf, **V_TOL)
    # pair order (the default): the same attention scores, GQA included
    qp, kp, vp = m(x, positions)
    assert torch.equal(vp, v) and not torch.allclose(qp, q)

    def scores(q, k):
        return torch.einsum("bshd,bthd->bhst", q, k.repeat_interleave(heads // kv_heads, dim=2))

    torch.testing.assert_close(scores(qp, kp), scores(q, k), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(scores(qp, kp), scores(q_hf, k_hf), rtol=1e-5, atol=tol["atol"] * 4 * head_dim)
    # broadcast positions: (1, S) for (B, S, D), as HF's position_ids often are
    q1, _, _ = m(x, torch.arange(32)[None])
    q2, _, _ = m(x, torch.arange(32).expand(2, 32))
    assert torch.equal(q1, q2)


def test_module_state_dict_is_hugging_faces():
    transformers = pytest.importorskip("transformers")
    attn, norm, _ = _hf_modules(transformers, 64, 4, 2, 16, ROPES["default"], bias=True)
    hf_sd = {k: v for k, v in attn.state_dict().items() if not k.startswith("o_proj")}
    hf_sd["norm.weight"] = norm.weight.detach()
    m = coda.nn.RMSNormQKVRoPE(64, 4, 2, bias=True, dtype=torch.float64)
    m.load_state_dict(hf_sd)
    sd = m.state_dict()
    assert set(sd) == set(hf_sd)
    for key in sd:
        assert torch.equal(sd[key], hf_sd[key]), key
        assert sd[key].is_contiguous()
    # stored pair-permuted, the rows [q; k; v]
    w = torch.cat([hf_sd[f"{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(m.qkv_weight, ops.rope_permute_qk(w, 16, 4, 2))
    assert torch.equal(m.qkv_bias, ops.rope_permute_qk(torch.cat([hf_sd[f"{p}.bias"] for p in
                                                                  ("q_proj", "k_proj", "v_proj")]), 16, 4, 2))
    # round trips: HF keys into a fresh module, coda's own keys too
    m2 = coda.nn.RMSNormQKVRoPE(64, 4, 2, bias=True, dtype=torch.float64)
    m2.load_state_dict(sd)
    assert torch.equal(m2.qkv_weight, m.qkv_weight) and torch.equal(m2.qkv_bias, m.qkv_bias)
    m3 = coda.nn.RMSNormQKVRoPE(64, 4, 2, bias=True, dtype=torch.float64)
    m3.load_state_dict({"qkv_weight": m.qkv_weight.detach(), "qkv_bias": m.qkv_bias.detach(),
                        "norm.weight": hf_sd["norm.weight"]})
    assert torch.equal(m3.qkv_weight, m.qkv_weight)
    # adjacent-pairs checkpoints are stored as they are
    m4 = coda.nn.RMSNormQKVRoPE(64, 4, 2, bias=True, rotate_half=False, dtype=torch.float64)
    m4.load_state_dict(hf_sd)
    assert torch.equal(m4.qkv_weight, w)
    assert all(torch.equal(v, hf_sd[k]) for k, v in m4.state_dict().items())
    # nested, prefixes kept; freq is not in the state_dict
    outer = torch.nn.ModuleDict({"attn": coda.nn.RMSNormQKVRoPE(64, 4, 2)})
    assert sorted(outer.state_dict()) == ["attn.k_proj.weight", "attn.norm.weight", "attn.q_proj.weight",
                                          "attn.v_proj.weight"]
    outer.load_state_dict(outer.state_dict())


def test_module_freq_survives_dtype_casts():
    m = coda.nn.RMSNormQKVRoPE(64, 4, 2, rope_theta=500000.0)
    want = ops.rope_frequencies(16, 4, 2, 500000.0)
    m.to(torch.bfloat16).double().half()
    assert m.qkv_weight.dtype == torch.float16
    assert m.freq.dtype == torch.float32 and torch.equal(m.freq, want)
    assert "freq_bits" not in m.state_dict()


def test_module_inv_freq_and_defaults():
    inv = _inv_freq64(32, 10000.0) / 4
    m = coda.nn.RMSNormQKVRoPE(128, 4, 4, inv_freq=inv)
    assert m.head_dim == 32 and m.qkv_weight.shape == (3 * 128, 128)
    assert torch.equal(m.freq, ops.rope_frequencies(32, 4, 4, inv_freq=inv))
    m.reset_parameters()
    assert torch.equal(m.freq, ops.rope_frequencies(32, 4, 4, inv_freq=inv))
    q, k, v = m(torch.randn(5, 128), torch.arange(5))
    assert q.shape == k.shape == v.shape == (5, 4, 32)


# ---- argument errors

def test_errors_name_the_argument():
    hd, nh, nkv, d = 16, 2, 1, 32
    x, g, w, b = _rand(3, 4, d), torch.ones(d, dtype=torch.float64), _rand(64, d), _rand(64)
    pos, freq = torch.arange(12).view(3, 4), ops.rope_frequencies(hd, nh, nkv)
    op = ops.rmsnorm_linear_rope
    with pytest.raises(ValueError, match=r"positions must be an int32 or int64 tensor of shape \(3, 4\).*got "
                                         r"torch.float32"):
        op(x, g, w, pos.float(), freq)
    with pytest.raises(ValueError, match=r"positions must be .* of shape \(3, 4\).*got torch.int64 \(12,\)"):
        op(x, g, w, pos.view(12), freq)
    with pytest.raises(ValueError, match="positions must be .*got list"):
        op(x, g, w, [0, 1, 2], freq)
    with pytest.raises(ValueError, match=r"freq must be a float32 tensor of shape \(64,\).*got torch.float64"):
        op(x, g, w, pos, freq.double())
    with pytest.raises(ValueError, match=r"freq must be a float32 tensor of shape \(64,\).*got torch.float32 \(32,\)"):
        op(x, g, w, pos, freq[:32])
    with pytest.raises(ValueError, match=r"weight must have an even number of rows \(N, D\)"):
        op(x, g, w[:63], pos, freq[:63])
    with pytest.raises(ValueError, match=r"x has shape \(3, 4, 32\), but weight \(64, 16\)"):
        op(x, g, w[:, :16], pos, freq)
    with pytest.raises(ValueError, match="norm_weight is required"):
        op(x, None, w, pos, freq)
    with pytest.raises(ValueError, match=r"norm_weight must have shape \(32,\)"):
        op(x, g[:16], w, pos, freq)
    with pytest.raises(ValueError, match=r"bias must have shape \(64,\)"):
        op(x, g, w, pos, freq, b[:32])
    with pytest.raises(ValueError, match="stats must be a float32 tensor of shape"):
        op(x, g, w, pos, freq, stats=torch.zeros(3, 4, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="eps must be a finite float"):
        op(x, g, w, pos, freq, eps=float("nan"))
    with pytest.raises(TypeError, match="weight has dtype torch.float32, expected torch.float64"):
        op(x, g, w.float(), pos, freq)


def test_layout_errors_name_the_argument():
    with pytest.raises(ValueError, match="rope_frequencies: head_dim must be even"):
        ops.rope_frequencies(15, 2, 1)
    with pytest.raises(ValueError, match="rope_frequencies: n_kv_heads must be a positive int, got 0"):
        ops.rope_frequencies(16, 2, 0)
    with pytest.raises(ValueError, match="rope_frequencies: theta must be a finite number > 0"):
        ops.rope_frequencies(16, 2, 1, theta=0.0)
    with pytest.raises(ValueError, match=r"rope_frequencies: inv_freq must be a floating-point tensor of shape "
                                         r"\(8,\)"):
        ops.rope_frequencies(16, 2, 1, inv_freq=torch.ones(16))
    with pytest.raises(ValueError, match=r"rope_permute_qk: dimension 0 of the tensor must have .* = 64 entries"):
        ops.rope_permute_qk(torch.zeros(60, 8), 16, 2, 1)
    with pytest.raises(ValueError, match=r"rope_unpermute_qk: dimension -1 of the tensor must have"):
        ops.rope_unpermute_qk(torch.zeros(64, 8), 16, 2, 1, dim=-1)
    with pytest.raises(ValueError, match="rope_permute_qk: head_dim must be even"):
        ops.rope_permute_qk(torch.zeros(60, 8), 15, 2, 1)
    m = coda.nn.RMSNormQKVRoPE(64, 4, 2)
    sd = m.state_dict()
    with pytest.raises(RuntimeError, match=r"q_proj.weight, k_proj.weight, v_proj.weight have shapes "
                                           r"\[\(64, 64\), \(32, 64\), \(16, 64\)\], expected"):
        m.load_state_dict({**sd, "v_proj.weight": sd["v_proj.weight"][:16]})
    with pytest.raises(ValueError, match="rope_frequencies: head_dim must be even"):
        coda.nn.RMSNormQKVRoPE(64, 4, 2, head_dim=15)


# ---- the kernel path's call, against the spec's schema (a CPU stand-in for the op)

def _rope_cpu(x, norm_weight, weight, bias, positions, freq, stats, eps):
    assert positions.dtype == torch.int32 and positions.shape == (math.prod(x.shape[:-1]),)
    assert positions.is_contiguous()
    rstd = (stats if stats is not None else rms_stats_rows(x, eps))[1].reshape(*x.shape[:-1], 1)
    h = F.linear((x.float() * rstd * norm_weight.float()).to(x.dtype), weight, bias)
    y = rope._rotate_pairs(h, positions.view(x.shape[:-1]), freq)
    return (y, rms_stats_rows(x, eps) if stats is None else x.new_empty(0).float(),
            bias.float().clone() if bias is not None else weight.new_zeros(weight.shape[0]).float())


def _rope_backward_cpu(dy, x, norm_weight, weight, y, positions, freq, stats, shift, needs):
    raise NotImplementedError("not called: these tests run without gradients")


@pytest.fixture
def stand_in(monkeypatch):
    yield from cpu_stand_in(monkeypatch, {"rmsnorm_linear_rope": _rope_cpu, "rmsnorm_linear_rope_backward": _rope_backward_cpu})


@pytest.mark.parametrize("bias,with_stats", [(False, False), (True, True)])
def test_kernel_path_call_matches_the_schema(stand_in, bias, with_stats):
    hd, nh, nkv, d = 16, 2, 1, 32
    x, g, w = _rand(3, 4, d, dtype=torch.float32), torch.ones(d), _rand(64, d, seed=2, dtype=torch.float32)
    b = _rand(64, seed=3, dtype=torch.float32) if bias else None
    st = rms_stats_rows(x, EPS).t().reshape(3, 4, 2) if with_stats else None
    pos, freq = torch.arange(12).view(3, 4).flip(-1), ops.rope_frequencies(hd, nh, nkv)  # int64: cast inside

    def fn():
        return ops.rmsnorm_linear_rope(x, g, w, pos, freq, b, EPS, st)

    with torch.no_grad():
        got = fn()
        torch.testing.assert_close(got, ops.rmsnorm_linear_rope_reference(x, g, w, pos, freq, b, EPS, st),
                                   rtol=1e-5, atol=1e-5)
        compiled = compiled_once(fn)
    torch.testing.assert_close(compiled, got)
    args = (x, g, w, b, pos.reshape(-1).int(), freq, None if st is None else st.reshape(-1, 2).t(), EPS)
    torch.library.opcheck(torch.ops.coda.rmsnorm_linear_rope.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_cuda_fp32_is_a_visible_fallback():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the fallback warning is for CUDA tensors")
    x, g, w = torch.randn(4, 32, device="cuda"), torch.ones(32, device="cuda"), torch.randn(64, 32, device="cuda")
    with pytest.warns(coda.FallbackWarning, match="rmsnorm_linear_rope ran its reference path"):
        ops.rmsnorm_linear_rope(x, g, w, torch.arange(4, device="cuda"),
                                ops.rope_frequencies(16, 2, 1, device="cuda"))
