"""RMSNorm -> QKV projection -> rotary position embedding (RoPE) in one GEMM:
LLaMA's attention input, y = RoPE(RMSNorm(x)·Wᵀ + b).

The rotation acts on pairs of adjacent output columns (2i, 2i + 1), so the
epilogue holds both members of a pair. Checkpoints in Hugging Face's
rotate-half convention pair column j with j + head_dim/2 instead; their q and k
head rows are stored pair-permuted inside coda (rope_permute_qk: new row 2j =
old row j, new row 2j + 1 = old row j + hd/2, per q or k head; v untouched).
The output's q and k columns then come out in that pair order, which attention
does not see: q·kᵀ sums over the head dimension, and q and k share the
permutation. rope_unpermute_qk gives Hugging Face's order back where it is
needed (a KV cache exported to HF code). Checkpoints in the adjacent-pairs
convention (GPT-J, Meta's original LLaMA) need no permutation.

The angles come as data: `freq` (rope_frequencies), one float32 per output
column, the rotation in turns per position as a float-float pair (hi at even
columns, lo at odd ones, computed in float64 on the host), zero on v's columns.
The angle of token m is φ = 2π·pos[m]·(hi + lo): the kernel reduces the turns
exactly mod 1 before its sin/cos, so long positions keep their accuracy (about
3e-7 rad up to 131072 at θ = 500000, where fp32 angles as Hugging Face computes
them are off by 6e-3 rad; benchmarks/design/llama/README.md, D). Scaled
variants (llama3, NTK) are only other inv_freq values.

One C++ op per direction (torch.ops.coda.rmsnorm_linear_rope / _backward,
fakes here, autograd in C++). Kernels: bf16 with D and N multiples of 8; other
dtypes and CPU tensors run the reference path.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _kernels
from . import _checks
from ._common import autocast
from .norm import _f32, _stats_fake, _to_rows, normalize_reference

__all__ = ["rope_frequencies", "rope_permute_qk", "rope_unpermute_qk", "rmsnorm_linear_rope",
           "rmsnorm_linear_rope_reference", "head_norm_rope", "head_norm_rope_reference"]


if _kernels.available():
    @torch.library.register_fake("coda::rmsnorm_linear_rope")
    def _(x, norm_weight, weight, bias, positions, freq, stats, eps):
        m, n = math.prod(x.shape[:-1]), weight.shape[0]
        return x.new_empty(*x.shape[:-1], n), _stats_fake(x, m) if stats is None else _f32(x), _f32(x, n)

    @torch.library.register_fake("coda::rmsnorm_linear_rope_backward")
    def _(dy, x, norm_weight, weight, y, positions, freq, stats, shift, needs):
        e = x.new_empty
        return (e(x.shape) if needs[0] else e(0), e(x.shape[-1]) if needs[1] else e(0),
                e(weight.shape) if needs[2] else e(0), e(weight.shape[0]) if needs[3] else e(0))

    @torch.library.register_fake("coda::head_norm_rope")
    def _(x, weight, positions, inv_freq, eps):
        return x.new_empty(x.shape)

    @torch.library.register_fake("coda::head_norm_rope_backward")
    def _(dy, x, weight, positions, inv_freq, eps, needs):
        return x.new_empty(x.shape) if needs[0] else x.new_empty(0), \
            weight.new_empty(weight.shape) if needs[1] else x.new_empty(0)


# ---- the layout: frequencies and the q/k row permutation

def _check_heads(op: str, head_dim, n_heads, n_kv_heads) -> None:
    for name, v in (("head_dim", head_dim), ("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"coda.{op}: {name} must be a positive int, got {v!r}")
    if head_dim % 2:
        raise ValueError(f"coda.{op}: head_dim must be even (RoPE rotates pairs), got {head_dim}")


def rope_frequencies(head_dim: int, n_heads: int, n_kv_heads: int, theta: float = 10000.0, device=None,
                     inv_freq: Optional[Tensor] = None) -> Tensor:
    """The `freq` of rmsnorm_linear_rope: float32 (N,), N = (n_heads + 2·n_kv_heads)·head_dim,
    one value per output column of the QKV projection [q heads | k heads | v].

    In each q and k head, pair i (columns 2i, 2i + 1) rotates by inv_freq_i
    radians per position, inv_freq_i = theta^(−2i/head_dim) unless inv_freq
    ((head_dim/2,) float, e.g. llama3's scaled frequencies) is given; stored in
    turns, τ_i = inv_freq_i / 2π, as hi = fp32(τ_i) at column 2i and
    lo = fp32(τ_i − hi) at 2i + 1, computed in float64. v's columns are 0.
    """
    op = "rope_frequencies"
    _check_heads(op, head_dim, n_heads, n_kv_heads)
    half = head_dim // 2
    if inv_freq is None:
        if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not 0 < theta < math.inf:
            raise ValueError(f"coda.{op}: theta must be a finite number > 0, got {theta!r}")
        inv = float(theta) ** (-2.0 * torch.arange(half, dtype=torch.float64) / head_dim)
    else:
        if not isinstance(inv_freq, Tensor) or not inv_freq.is_floating_point() or tuple(inv_freq.shape) != (half,):
            got = (f"{inv_freq.dtype} {tuple(inv_freq.shape)}" if isinstance(inv_freq, Tensor)
                   else type(inv_freq).__name__)
            raise ValueError(f"coda.{op}: inv_freq must be a floating-point tensor of shape ({half},) "
                             f"(head_dim / 2), got {got}")
        inv = inv_freq.detach().to("cpu", torch.float64)
    turns = inv / (2 * math.pi)
    hi = turns.float()
    lo = (turns - hi.double()).float()
    head = torch.stack([hi, lo], -1).reshape(head_dim)
    out = torch.cat([head.repeat(n_heads + n_kv_heads), torch.zeros(n_kv_heads * head_dim)])
    return out.to(device) if device is not None else out


def _permute(op: str, t: Tensor, head_dim: int, n_heads: int, n_kv_heads: int, dim: int, inverse: bool) -> Tensor:
    _check_heads(op, head_dim, n_heads, n_kv_heads)
    if not isinstance(t, Tensor) or t.dim() < 1:
        raise TypeError(f"coda.{op}: the tensor must be a Tensor with at least one dimension, got "
                        f"{type(t).__name__ if not isinstance(t, Tensor) else 'a scalar'}")
    n = (n_heads + 2 * n_kv_heads) * head_dim
    if not -t.dim() <= dim < t.dim() or t.shape[dim] != n:
        raise ValueError(f"coda.{op}: dimension {dim} of the tensor must have (n_heads + 2·n_kv_heads)·head_dim = "
                         f"({n_heads} + 2·{n_kv_heads})·{head_dim} = {n} entries ([q; k; v]), got shape "
                         f"{tuple(t.shape)}")
    t = t.movedim(dim, 0)
    heads, half = n_heads + n_kv_heads, head_dim // 2
    qk, v = t[:heads * head_dim], t[heads * head_dim:]
    split = (heads, half, 2) if inverse else (heads, 2, half)
    qk = qk.reshape(*split, *t.shape[1:]).transpose(1, 2).reshape(heads * head_dim, *t.shape[1:])
    return torch.cat([qk, v]).movedim(0, dim).contiguous()


def rope_permute_qk(t: Tensor, head_dim: int, n_heads: int, n_kv_heads: int, dim: int = 0) -> Tensor:
    """Hugging Face's rotate-half layout -> coda's pair layout, a copy: along
    `dim` of t (the rows [q; k; v] of a QKV weight (N, D) or bias (N,); dim=-1
    for activations (..., N)), in each q and k head new row 2j = old row j and
    new row 2j + 1 = old row j + head_dim/2; v unchanged."""
    return _permute("rope_permute_qk", t, head_dim, n_heads, n_kv_heads, dim, False)


def rope_unpermute_qk(t: Tensor, head_dim: int, n_heads: int, n_kv_heads: int, dim: int = 0) -> Tensor:
    """The inverse of rope_permute_qk: coda's pair layout -> rotate-half, a copy
    (dim=-1 turns rmsnorm_linear_rope's output into what Hugging Face's
    apply_rotary_pos_emb gives)."""
    return _permute("rope_unpermute_qk", t, head_dim, n_heads, n_kv_heads, dim, True)


# ---- the op

def _rotate_pairs(h: Tensor, positions: Tensor, freq: Tensor) -> Tensor:
    """Rotates each column pair (2i, 2i + 1) of h (..., N) by 2π·pos·(hi + lo),
    the angle in float64 and reduced mod 1 turn first; returns h's dtype."""
    turns = freq[0::2].double() + freq[1::2].double()  # exact: two floats
    t = positions.to(torch.float64).unsqueeze(-1) * turns
    phi = (2 * math.pi) * (t - torch.round(t))
    c, s = torch.cos(phi), torch.sin(phi)
    pairs = h.double().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).flatten(-2).to(h.dtype)


def rmsnorm_linear_rope_reference(x: Tensor, norm_weight: Tensor, weight: Tensor, positions: Tensor, freq: Tensor,
                                  bias: Optional[Tensor] = None, eps: Optional[float] = None,
                                  stats: Optional[Tensor] = None) -> Tensor:
    """RoPE(RMSNorm(x)·weightᵀ + bias), unfused; the rotation in float64 from
    freq's hi + lo, the result in x's dtype."""
    eps = _checks.eps_of(eps, False, x, "rmsnorm_linear_rope")
    n = normalize_reference(x, norm_weight, None, eps, False, _to_rows(stats))
    return _rotate_pairs(F.linear(n, weight, bias), positions, freq).to(x.dtype)


def _check_rope(op: str, x: Tensor, norm_weight: Tensor, weight: Tensor, positions: Tensor, freq: Tensor,
                bias: Optional[Tensor], stats: Optional[Tensor]) -> None:
    _checks.x_input(x, op)
    _checks.weight("weight", weight, x.shape[-1], op, "x", x.shape)
    n = weight.shape[0]
    if n % 2:
        raise ValueError(f"coda.{op}: weight must have an even number of rows (N, D), RoPE rotating column pairs, "
                         f"got {tuple(weight.shape)}")
    if norm_weight is None:
        raise ValueError(f"coda.{op}: norm_weight is required")
    _checks.vector("norm_weight", norm_weight, x.shape[-1], op, f" (the last dimension of x, {tuple(x.shape)})")
    _checks.vector("bias", bias, n, op, " (out_features of weight)")
    if not isinstance(positions, Tensor) or positions.dtype not in (torch.int32, torch.int64) \
            or tuple(positions.shape) != tuple(x.shape[:-1]):
        got = f"{positions.dtype} {tuple(positions.shape)}" if isinstance(positions, Tensor) \
            else type(positions).__name__
        raise ValueError(f"coda.{op}: positions must be an int32 or int64 tensor of shape {tuple(x.shape[:-1])} "
                         f"(x's without its last dimension: one position per token), got {got}")
    if positions.device != x.device:
        raise ValueError(f"coda.{op}: positions is on {positions.device}, expected {x.device} (the device of x)")
    if not isinstance(freq, Tensor) or freq.dtype != torch.float32 or tuple(freq.shape) != (n,):
        got = f"{freq.dtype} {tuple(freq.shape)}" if isinstance(freq, Tensor) else type(freq).__name__
        raise ValueError(f"coda.{op}: freq must be a float32 tensor of shape ({n},) (out_features of weight), "
                         f"as rope_frequencies returns it, got {got}")
    if freq.device != x.device:
        raise ValueError(f"coda.{op}: freq is on {freq.device}, expected {x.device} (the device of x)")
    _checks.stats(stats, x, op)


def rmsnorm_linear_rope(x: Tensor, norm_weight: Tensor, weight: Tensor, positions: Tensor, freq: Tensor,
                        bias: Optional[Tensor] = None, eps: Optional[float] = None,
                        stats: Optional[Tensor] = None) -> Tensor:
    """RoPE(RMSNorm(x)·weightᵀ + bias) in one GEMM: the norm folded into it,
    the bias and the rotation in its epilogue.

    x: (..., D); norm_weight: (D,); weight: (N, D), the [q; k; v] rows with q
    and k pair-permuted (rope_permute_qk) for rotate-half checkpoints; bias:
    (N,) (permuted the same way) or None; positions: int32 or int64 of shape
    x.shape[:-1], any order (packed sequences), exact below 2^24; freq: float32
    (N,) from rope_frequencies; eps None: machine epsilon, as nn.RMSNorm;
    stats: optional float32 (..., 2) per-row (0, rstd) of x, e.g. from
    linear_residual. Returns (..., N), q and k in the pair layout.
    """
    op = "rmsnorm_linear_rope"
    _check_rope(op, x, norm_weight, weight, positions, freq, bias, stats)
    eps = _checks.eps_of(eps, False, x, op)
    x, norm_weight, weight, bias = autocast(x, norm_weight, weight, bias)
    for name, t in (("norm_weight", norm_weight), ("weight", weight), ("bias", bias)):
        if t is not None:
            _checks.like(name, t, x, op)
    use = _kernels.use_kernels(op, x, _kernels.BF16, (x.shape[-1], weight.shape[0]))
    if not use:
        return rmsnorm_linear_rope_reference(x, norm_weight, weight, positions, freq, bias, eps, stats)
    pos = positions.reshape(-1).to(torch.int32).contiguous()
    return torch.ops.coda.rmsnorm_linear_rope.default(x, norm_weight, weight, bias, pos, freq, _to_rows(stats),
                                                      eps)[0]


# ---- Qwen3's and Gemma 3's q / k path: a per-head RMSNorm, then RoPE

HEAD_DIMS = (64, 128, 256)


def head_norm_rope_reference(x: Tensor, weight: Tensor, positions: Tensor, inv_freq: Tensor, eps: float) -> Tensor:
    """RoPE(RMSNorm_head(x)) unfused, as Hugging Face computes it: the float32 angles
    positions · inv_freq, their cos and sin in x's dtype, the pair (2j, 2j+1) rotated by the
    j-th; the reference path and the tests' baseline."""
    angles = positions.to(torch.float32)[..., None, None] * inv_freq.to(torch.float32)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    even, odd = F.rms_norm(x, (x.shape[-1],), weight, eps).unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), -1).flatten(-2)


def head_norm_rope(x: Tensor, weight: Tensor, positions: Tensor, inv_freq: Tensor, eps: float) -> Tensor:
    """Each head's RMSNorm, then its rotary embedding, in one pass (Qwen3's and Gemma 3's
    q_norm / k_norm sit between the projection and RoPE), forward and backward.

    x: (..., heads, head_dim) in coda's pair order (a head's dims j and j + head_dim/2
    adjacent, as rmsnorm_linear_rope writes q and k); weight: (head_dim,) in the same order
    (the norm's scale as applied: Gemma's 1 + w); positions: integers of shape x.shape[:-2]
    (or broadcastable to it); inv_freq: float32 (head_dim/2,), the rotation of pair j in
    radians per position; eps: the norm's. Kernels: bf16 / fp16 CUDA tensors with head_dim
    64, 128 or 256; anything else runs head_norm_rope_reference. Returns x's shape.
    """
    op = "head_norm_rope"
    if x.dim() < 2:
        raise ValueError(f"coda.{op}: x must be (..., heads, head_dim), got shape {tuple(x.shape)}")
    hd = x.shape[-1]
    if weight.shape != (hd,):
        raise ValueError(f"coda.{op}: weight must be (head_dim,) = ({hd},), got {tuple(weight.shape)}")
    if inv_freq.shape != (hd // 2,) or hd % 2:
        raise ValueError(f"coda.{op}: inv_freq must be (head_dim / 2,) = ({hd // 2},) for an even head_dim, "
                         f"got {tuple(inv_freq.shape)}")
    if positions.is_floating_point() or positions.is_complex():
        raise TypeError(f"coda.{op}: positions must be an integer tensor, got {positions.dtype}")
    for name, t in (("weight", weight), ("positions", positions), ("inv_freq", inv_freq)):
        if t.device != x.device:
            raise ValueError(f"coda.{op}: {name} is on {t.device}, expected {x.device} (the device of x)")
    positions = positions.expand(x.shape[:-2])
    other = None if hd in HEAD_DIMS else f"head_dim {hd} has no kernel ({', '.join(map(str, HEAD_DIMS))} have)"
    if not _kernels.use_kernels(op, x, _kernels.BF16_FP16, [hd], other):
        return head_norm_rope_reference(x, weight, positions, inv_freq, eps)
    return torch.ops.coda.head_norm_rope.default(x, weight.to(x.dtype), positions, inv_freq.to(torch.float32),
                                                 float(eps))
