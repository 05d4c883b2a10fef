from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import nn

from .. import ops
from ._parts import part_property
from .glu_mlp import exported, replace_key
from .norm_linear import norm_eps, norm_gamma

_PROJ = ("q_proj", "k_proj", "v_proj")


class RMSNormQKVRoPE(nn.Module):
    """LLaMA's attention input: RMSNorm -> q, k, v projections -> RoPE on q and
    k, in one GEMM (coda.ops.rmsnorm_linear_rope). Qwen2's with bias=True.

    Parameters: ``norm`` (nn.RMSNorm, LLaMA's input_layernorm), ``qkv_weight``
    (N, D), N = (num_heads + 2·num_kv_heads)·head_dim, the rows [q; k; v] with
    q's and k's pair-permuted (coda.ops.rope_permute_qk) when rotate_half, and
    ``qkv_bias`` (N,), the same rows, when bias. ``freq`` (float32 (N,), from
    coda.ops.rope_frequencies) is no parameter and not in the state_dict; it is
    kept as its int32 bits, so that model.to(dtype) leaves it exact.

    state_dict() has Hugging Face's keys in HF's layout: ``q_proj.weight``,
    ``k_proj.weight``, ``v_proj.weight`` (+ ``.bias`` each when bias; copies,
    views with keep_vars=True) and ``norm.weight``; load_state_dict takes
    those, or ``qkv_weight`` / ``qkv_bias`` already in coda's layout.

    rotate_half: the checkpoint's convention. True (Hugging Face's LLaMA,
    Mistral, Qwen): head dims j and j + head_dim/2 rotate together, and the
    module stores q and k rows pair-permuted. False (GPT-J, Meta's original
    LLaMA): adjacent dims rotate together, stored as they are. inv_freq:
    optional (head_dim/2,) frequencies in radians per position for scaled
    variants (llama3, NTK); else rope_theta^(−2i/head_dim). zero_centered_gamma
    (Transformer Engine's name): the norm scales by 1 + norm.weight (Gemma's), the
    weight initialized to 0.

    forward(x, positions, stats=None, hf_order=False) -> (q, k, v), each
    (..., heads, head_dim), views of one (..., N) output. x: (..., D);
    positions: int32/int64, x.shape[:-1] or broadcastable to it (e.g. (1, S)
    for (B, S, D)), any order (packed sequences); stats: optional float32
    (..., 2) row statistics of x (linear_residual's). q and k come in the pair
    layout, which attention does not see: q·kᵀ sums over the head dimension,
    and q and k share the permutation (v is never permuted). hf_order=True
    un-permutes q and k (a copy) to equal Hugging Face's apply_rotary_pos_emb
    output, for code that reads them dim by dim (e.g. a KV cache shared with
    HF code); with rotate_half=False the order is the checkpoint's already.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: Optional[int] = None,
                 rope_theta: float = 10000.0, eps: Optional[float] = None, bias: bool = False,
                 rotate_half: bool = True, inv_freq: Optional[torch.Tensor] = None, zero_centered_gamma: bool = False,
                 device=None, dtype=None):
        super().__init__()
        self.zero_centered_gamma = bool(zero_centered_gamma)
        head_dim = hidden_size // num_heads if head_dim is None else head_dim
        self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim = hidden_size, num_heads, num_kv_heads, \
            head_dim
        self.rope_theta, self.rotate_half = rope_theta, bool(rotate_half)
        self._inv_freq = None if inv_freq is None else inv_freq.detach().to("cpu", torch.float64)
        freq = ops.rope_frequencies(head_dim, num_heads, num_kv_heads, rope_theta, inv_freq=self._inv_freq)
        self.sizes = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
        n = sum(self.sizes)
        self.norm = nn.RMSNorm(hidden_size, eps=eps, device=device, dtype=dtype)
        self.qkv_weight = nn.Parameter(torch.empty(n, hidden_size, device=device, dtype=dtype))
        self.qkv_bias = nn.Parameter(torch.empty(n, device=device, dtype=dtype)) if bias else None
        self.register_buffer("freq_bits", freq.view(torch.int32).to(device), persistent=False)
        self.reset_parameters()
        self.register_state_dict_post_hook(_save_qkv)
        self.register_load_state_dict_pre_hook(_load_qkv)

    # the state_dict's q_proj / k_proj / v_proj as attributes (coda/nn/_parts.py)
    q_proj, k_proj, v_proj = (part_property(p, i, lambda m, kind: m._parts(kind)) for i, p in enumerate(_PROJ))

    def _parts(self, kind: str):
        t = getattr(self, "qkv_" + kind)
        return None if t is None else self.unpermute(t.detach()).split(self.sizes)

    @property
    def freq(self) -> torch.Tensor:
        """float32 (N,): the rotation per column, in turns per position (rope_frequencies)."""
        return self.freq_bits.view(torch.float32)

    def reset_parameters(self) -> None:
        """The weight and bias as three nn.Linear initialize them, and freq recomputed."""
        nn.init.kaiming_uniform_(self.qkv_weight, a=math.sqrt(5))
        if self.zero_centered_gamma and self.norm.weight is not None and not self.norm.weight.is_meta:
            nn.init.zeros_(self.norm.weight)
        if self.qkv_bias is not None:
            bound = 1 / math.sqrt(self.hidden_size)
            nn.init.uniform_(self.qkv_bias, -bound, bound)
        freq = ops.rope_frequencies(self.head_dim, self.num_heads, self.num_kv_heads, self.rope_theta,
                                    inv_freq=self._inv_freq)
        with torch.no_grad():
            self.freq_bits.copy_(freq.view(torch.int32))

    def permute(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """A [q; k; v] tensor in the checkpoint's layout -> this module's (a copy)."""
        return ops.rope_permute_qk(t, self.head_dim, self.num_heads, self.num_kv_heads, dim) if self.rotate_half \
            else t

    def unpermute(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This module's layout -> the checkpoint's."""
        return ops.rope_unpermute_qk(t, self.head_dim, self.num_heads, self.num_kv_heads, dim) if self.rotate_half \
            else t

    def forward(self, x: torch.Tensor, positions: torch.Tensor, stats: Optional[torch.Tensor] = None,
                hf_order: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if isinstance(positions, torch.Tensor) and isinstance(x, torch.Tensor) and positions.shape != x.shape[:-1]:
            positions = positions.expand(x.shape[:-1])
        y = ops.rmsnorm_linear_rope(x, norm_gamma(self.norm.weight, self.zero_centered_gamma), self.qkv_weight,
                                    positions, self.freq, self.qkv_bias, norm_eps(self.norm), stats)
        q, k, v = y.split(self.sizes, -1)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in (q, k, v))
        if hf_order and self.rotate_half:
            q, k = _rotate_half_order(q), _rotate_half_order(k)
        return q, k, v

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, rope_theta={self.rope_theta}, rotate_half={self.rotate_half}, "
                f"bias={self.qkv_bias is not None}, zero_centered_gamma={self.zero_centered_gamma}")


def _rotate_half_order(t: torch.Tensor) -> torch.Tensor:
    """(..., heads, head_dim) in pair order (2j = j, 2j + 1 = j + hd/2) -> rotate-half order."""
    return t.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def _save_qkv(module, state_dict, prefix, local_metadata) -> None:
    for kind in ("weight", "bias"):
        key = prefix + "qkv_" + kind
        if key in state_dict:
            t = state_dict[key]
            parts = module.unpermute(t).split(module.sizes)
            replace_key(state_dict, prefix, "qkv_" + kind, zip((f"{p}.{kind}" for p in _PROJ), exported(t, parts)))


def _load_qkv(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
    for kind in ("weight", "bias"):
        keys = [f"{prefix}{p}.{kind}" for p in _PROJ]
        if not all(k in state_dict for k in keys):
            continue  # qkv_weight / qkv_bias themselves, or a partial dict: load_state_dict reports what is missing
        want = [(s, module.hidden_size) if kind == "weight" else (s,) for s in module.sizes]
        got = [tuple(state_dict[k].shape) for k in keys]
        if got != want:
            error_msgs.append(f"{', '.join(keys)} have shapes {got}, expected {want} (num_heads={module.num_heads}, "
                              f"num_kv_heads={module.num_kv_heads}, head_dim={module.head_dim})")
            continue
        state_dict[prefix + "qkv_" + kind] = module.permute(torch.cat([state_dict.pop(k) for k in keys]))
