"""The LLaMA block without its attention (`--only llama`), composed from coda's ops as a
user would, against the same block in plain PyTorch (eager, torch.compile, Liger-Kernel's
RMSNorm, SiLU-mul and RoPE) and against its GEMMs alone in cuBLAS. `attn` stands in for
attention's output:

    q, k, v = RoPE(RMSNorm1(x)·W_qkvᵀ)            (tokens, (heads + 2·kv_heads)·head_dim)
    y       = attn·W_oᵀ + x
    z       = y + down(silu(gate(RMSNorm2(y))) ⊙ up(RMSNorm2(y)))          (tokens, d)

Cases llama_block_fwd_t<tokens>_d<d> (inference: q, k, v and z) and
llama_block_fwd_bwd_t<tokens>_d<d> (the gradients w.r.t. x, attn and every parameter,
given fixed random gradients of q, k, v and z). The fixed gradients of q, k, v are what
attention's backward would hand back: the RoPE backward, the QKV dgrad and wgrad and
the norm's backward all run on them, and z's gradient reaches attn through o-proj's
dgrad, as in training. Every impl gets the same gradients (coda's q/k columns in its
pair order, rope_permute_qk of them, a copy made once), so each does the same work.

Default points: LLaMA-3-8B (d 4096, ffn 14336, 32 q / 8 kv heads of 128) at 16,384
tokens and LLaMA-3.2-1B (d 2048, ffn 8192, 32 / 8 heads of 64) at 8,192 tokens, bf16,
sequences of 4096 tokens (positions 0..4095 each), RoPE θ = 500000, eps 1e-5.
`--tokens` / `--dims` pick other points (a d without a LLaMA model of that width
gets LLaMA-like heads of 64 or 128 and ffn = 8d/3 rounded up to 256).

Impls:
  coda     rmsnorm_linear_rope, linear_residual (reducing RMSNorm2's row statistics),
           norm_glu_mlp taking them; weights in coda's layouts (q/k rows pair-permuted,
           gate/up interleaved), converted once before timing
  cublas   the block's 12 GEMMs alone (torch.matmul): QKV, o-proj, gate/up as one
           (2F, d) GEMM, down, each one's dgrad and wgrad with the backward
  eager    Hugging Face's LlamaDecoderLayer arithmetic: F.rms_norm, one QKV GEMM split
           into heads, rotate-half RoPE with cos/sin tables, gate_proj and up_proj,
           F.silu(g) * u
  compile  torch.compile of eager, compiled once per case before timing
  liger    eager with LigerRMSNormFunction, LigerSiLUMulFunction and liger_rotary_pos_emb
           (where Liger-Kernel is installed)

The cos/sin tables (eager, liger) and coda's positions and freq are built once per case:
a model builds them once per step for all its layers. Memory at 8B x 16,384 tokens: about
2.5 GB of inputs, weights (coda's converted copies included) and given gradients, shared
by all impls, and a step's own activations and gradients, about 6 GB at the most (eager's);
one step is live at a time, and each point frees its tensors before the next.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

import coda

from . import liger, steps
from .timing import Runner

EPS = 1e-5
THETA = 500000.0
SEQ_LEN = 4096  # tokens per sequence; a token count it does not divide is one sequence


@dataclass(frozen=True)
class Config:
    model: str
    d: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        return self.q_size + 2 * self.kv_size


MODELS = {c.d: c for c in (Config("LLaMA-3.2-1B", 2048, 8192, 32, 8, 64),
                           Config("LLaMA-3.2-3B", 3072, 8192, 24, 8, 128),
                           Config("LLaMA-3-8B", 4096, 14336, 32, 8, 128),
                           Config("LLaMA-3-70B", 8192, 28672, 64, 8, 128))}
DEFAULT_POINTS = [(16384, 4096), (8192, 2048)]  # (tokens, d)


def config(d: int) -> Config:
    """The LLaMA model of width d, else LLaMA-like dimensions: heads of 64 (128 from d 3072),
    a quarter as many kv heads, ffn = 8d/3 rounded up to a multiple of 256."""
    if d in MODELS:
        return MODELS[d]
    head_dim = 128 if d >= 3072 else 64
    if d % head_dim:
        raise ValueError(f"the LLaMA block needs d a multiple of {head_dim} (its head_dim), got {d}")
    heads = d // head_dim
    return Config(f"LLaMA-like d{d}", d, 256 * math.ceil(8 * d / 3 / 256), heads, max(1, heads // 4), head_dim)


def seq_len(tokens: int) -> int:
    return SEQ_LEN if tokens % SEQ_LEN == 0 else tokens


def points(tokens: Optional[List[int]], dims: Optional[List[int]], gpu: bool) -> List[Tuple[int, int]]:
    """(tokens, d) of each case pair: the defaults, or every --tokens x --dims (on the GPU a
    --dims point without --tokens takes its default token count, else 8192)."""
    if not gpu:
        return [(t, d) for d in (dims or [256]) for t in (tokens or [256])]
    if not tokens and not dims:
        return list(DEFAULT_POINTS)
    default = {d: t for t, d in DEFAULT_POINTS}
    return [(t, d) for d in (dims or [d for _, d in DEFAULT_POINTS]) for t in (tokens or [default.get(d, 8192)])]


def describe(tokens: int, d: int) -> Dict[str, object]:
    """What a results file says about one point."""
    return {**asdict(config(d)), "tokens": tokens, "seq_len": seq_len(tokens), "rope_theta": THETA, "eps": EPS}


# ---- the block, four ways

def coda_block(positions: torch.Tensor, freq: torch.Tensor) -> Callable:
    """The block from coda's ops; w_qkv pair-permuted, w_gate_up interleaved."""
    def block(x, attn, g1, w_qkv, w_o, g2, w_gate_up, w_down):
        qkv = coda.ops.rmsnorm_linear_rope(x, g1, w_qkv, positions, freq, eps=EPS)
        # o-proj's epilogue adds the residual and reduces RMSNorm2's row statistics,
        # which norm_glu_mlp then takes instead of a pass over y
        y, stats = coda.ops.linear_residual(attn, w_o, None, x, "RMSNorm", EPS)
        z = coda.ops.norm_glu_mlp(y, g2, None, w_gate_up, w_down, "RMSNorm", EPS, "silu", residual=y, stats=stats)
        return qkv, z
    return block


def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    half = t.shape[-1] // 2
    return torch.cat((-t[..., half:], t[..., :half]), dim=-1)


def torch_rope(q, k, cos, sin):
    """Hugging Face's apply_rotary_pos_emb on (batch, seq, heads, head_dim), cos/sin (seq, head_dim)."""
    cos, sin = cos[:, None], sin[:, None]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def torch_rms_norm(t, weight, eps):
    return F.rms_norm(t, t.shape[-1:], weight, eps)


def torch_silu_mul(g, u):
    return F.silu(g) * u


def unfused_block(cfg: Config, batch: int, cos: torch.Tensor, sin: torch.Tensor, rms_norm: Callable,
                  silu_mul: Callable, rope: Callable) -> Callable:
    """The block as Hugging Face's LlamaDecoderLayer computes it (one QKV GEMM), with the
    given norm, SiLU-mul and RoPE; q, k, v come out (batch, seq, heads, head_dim)."""
    def heads(t):
        return t.unflatten(0, (batch, -1)).unflatten(-1, (-1, cfg.head_dim))

    def block(x, attn, g1, w_qkv, w_o, g2, w_gate, w_up, w_down):
        q, k, v = F.linear(rms_norm(x, g1, EPS), w_qkv).split([cfg.q_size, cfg.kv_size, cfg.kv_size], -1)
        q, k = rope(heads(q), heads(k), cos, sin)
        y = F.linear(attn, w_o) + x
        n = rms_norm(y, g2, EPS)
        z = F.linear(silu_mul(F.linear(n, w_gate), F.linear(n, w_up)), w_down) + y
        return q, k, heads(v), z
    return block


def liger_ops() -> Tuple[Optional[Tuple[Callable, Callable, Callable]], str]:
    """(rms_norm, silu_mul, rope) from Liger-Kernel in unfused_block's terms, or (None, why not)."""
    fns, why_not = liger.llama()
    if fns is None:
        return None, why_not
    rms_norm, silu_mul, rotary = fns

    def rope(q, k, cos, sin):  # Liger takes HF's (batch, heads, seq, head_dim) and cos/sin (1, seq, head_dim)
        q, k = rotary(q.transpose(1, 2), k.transpose(1, 2), cos[None], sin[None])
        return q.transpose(1, 2), k.transpose(1, 2)
    return (rms_norm, silu_mul, rope), ""


def cublas_step(cfg: Config, x, attn, w_qkv, w_o, w_gate_up, w_down, a, dqkv, dz,
                backward: bool) -> Callable[[], None]:
    """The block's GEMMs alone (torch.matmul): QKV, o-proj, gate/up (one (2F, d) GEMM) and
    down forward; with the backward each one's dgrad and wgrad, 12 in all. `a` (tokens, F)
    stands in for the gated activation, the gate/up output for its own gradient."""
    def step():
        torch.matmul(x, w_qkv.t())
        y = torch.matmul(attn, w_o.t())
        h = torch.matmul(y, w_gate_up.t())
        torch.matmul(a, w_down.t())
        if backward:
            for inp, w, g in ((a, w_down, dz), (y, w_gate_up, h), (attn, w_o, dz), (x, w_qkv, dqkv)):
                torch.matmul(g, w)
                torch.matmul(g.t(), inp)
    return step


def gemm_flops(cfg: Config, tokens: int, backward: bool) -> float:
    """2·tokens·(d·N_qkv + q_size·d + d·2F + F·d) forward, three times that with the backward."""
    d, f = cfg.d, cfg.ffn
    return (3.0 if backward else 1.0) * 2 * tokens * (d * cfg.qkv_size + cfg.q_size * d + d * 2 * f + f * d)


# ---- one point

def rope_tables(cfg: Config, tokens: int, dtype: torch.dtype, device: str):
    """(cos, sin) (seq, head_dim) in dtype, as Hugging Face's LlamaRotaryEmbedding builds them
    (the angles here in float64), and coda's int32 positions (tokens,) and freq (N,)."""
    seq = seq_len(tokens)
    inv_freq = THETA ** (-torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq
    emb = torch.cat((angles, angles), -1)
    cos, sin = emb.cos().to(device, dtype), emb.sin().to(device, dtype)
    positions = torch.arange(seq, dtype=torch.int32, device=device).repeat(tokens // seq)
    freq = coda.ops.rope_frequencies(cfg.head_dim, cfg.heads, cfg.kv_heads, THETA, device=device)
    return cos, sin, positions, freq


def coda_to_torch(cfg: Config, batch: int, backward: bool) -> Callable:
    """coda's result in eager's terms, for the comparison (untimed): q, k back in
    rotate-half order and split into heads; the gradients of the pair-permuted QKV
    weight unpermuted and of the interleaved gate/up weight split."""
    def heads(t):
        return t.unflatten(0, (batch, -1)).unflatten(-1, (-1, cfg.head_dim))

    def view(out):
        if backward:
            dx, dattn, dg1, dw_qkv, dw_o, dg2, dw_gate_up, dw_down = out
            dw_gate, dw_up = coda.ops.split_gate_up(dw_gate_up)
            return (dx, dattn, dg1, coda.ops.rope_unpermute_qk(dw_qkv, cfg.head_dim, cfg.heads, cfg.kv_heads),
                    dw_o, dg2, dw_gate, dw_up, dw_down)
        qkv, z = out
        qkv = coda.ops.rope_unpermute_qk(qkv, cfg.head_dim, cfg.heads, cfg.kv_heads, dim=-1)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], -1)
        return heads(q), heads(k), heads(v), z
    return view


def run(r: Runner, tokens: int, dims: Sequence[int], dtype: torch.dtype, device: str) -> None:
    fns, why_not = liger_ops() if r.gpu else (None, "Liger-Kernel's Triton kernels need a CUDA GPU")
    for d in dims:
        cfg = config(d)
        seq = seq_len(tokens)
        batch = tokens // seq
        print(f"  llama: {cfg.model}: d {cfg.d}, ffn {cfg.ffn}, {cfg.heads} q / {cfg.kv_heads} kv heads of "
              f"{cfg.head_dim}; {tokens} tokens = {batch} x {seq}", flush=True)
        torch.manual_seed(0)

        def rand(*shape, scale=1.0):
            return steps.rand(*shape, dtype=dtype, device=device, scale=scale)

        f = cfg.ffn
        # x, attn, RMSNorm1's weight, W_qkv ([q; k; v], rotate-half order), W_o, RMSNorm2's, gate, up, down
        params = steps.trainable([
            steps.residual_stream(tokens, d, dtype, device), rand(tokens, cfg.q_size),
            steps.norm_params(d, dtype, device)[0], rand(cfg.qkv_size, d, scale=d**-0.5),
            rand(d, cfg.q_size, scale=cfg.q_size**-0.5), steps.norm_params(d, dtype, device)[0],
            rand(f, d, scale=d**-0.5), rand(f, d, scale=d**-0.5), rand(d, f, scale=f**-0.5)])
        x, attn, g1, w_qkv, w_o, g2, w_gate, w_up, w_down = params
        # coda's layouts, converted once; x, attn and the other weights are shared
        w_qkv_pairs = coda.ops.rope_permute_qk(w_qkv.detach(), cfg.head_dim, cfg.heads, cfg.kv_heads)
        w_gate_up = coda.ops.interleave_gate_up(w_gate.detach(), w_up.detach())
        coda_params = [x, attn, g1, w_qkv_pairs.requires_grad_(True), w_o, g2, w_gate_up.requires_grad_(True), w_down]
        cos, sin, positions, freq = rope_tables(cfg, tokens, dtype, device)

        # the given gradients: attention's backward hands q, k, v theirs (batch, seq, heads, head_dim)
        dq = rand(batch, seq, cfg.heads, cfg.head_dim)
        dk, dv = rand(batch, seq, cfg.kv_heads, cfg.head_dim), rand(batch, seq, cfg.kv_heads, cfg.head_dim)
        dz = rand(tokens, d)
        dqkv = torch.cat([dq.reshape(tokens, -1), dk.reshape(tokens, -1), dv.reshape(tokens, -1)], -1)
        grads = [dq, dk, dv, dz]
        coda_grads = [coda.ops.rope_permute_qk(dqkv, cfg.head_dim, cfg.heads, cfg.kv_heads, dim=-1), dz]
        # Liger's RoPE backward rotates q's and k's gradients in place: its own copies (it
        # rotates them again each step, which changes values, not work)
        liger_grads = [dq.clone(), dk.clone(), dv, dz]

        a = rand(tokens, f)  # the cuBLAS floor's stand-in for the gated activation
        eager = unfused_block(cfg, batch, cos, sin, torch_rms_norm, torch_silu_mul, torch_rope)
        fused = coda_block(positions, freq)
        for backward in (False, True):
            case = f"llama_block_{'fwd_bwd' if backward else 'fwd'}_t{tokens}_d{d}"

            def step(fn, args=params, g=grads):
                return steps.forward_backward(fn, args, g) if backward else steps.forward(fn, args)

            impls = {"coda": step(fused, coda_params, coda_grads),
                     "cublas": cublas_step(cfg, x.detach(), attn.detach(), w_qkv.detach(), w_o.detach(),
                                           w_gate_up.detach(), w_down.detach(), a, dqkv, dz, backward),
                     "eager": step(eager), "compile": step(steps.compiled(eager))}
            if fns is not None:
                impls["liger"] = step(unfused_block(cfg, batch, cos, sin, *fns), params, liger_grads)
            else:
                r.skip(case, "liger", why_not)
            r.interleaved(case, impls, gemm_flops(cfg, tokens, backward), reference="eager",
                          views={"coda": coda_to_torch(cfg, batch, backward)})
            del impls
        del params, coda_params, grads, coda_grads, liger_grads, x, attn, g1, w_qkv, w_o, g2, w_gate, w_up, w_down
        del w_qkv_pairs, w_gate_up, a, dq, dk, dv, dz, dqkv, cos, sin, positions, freq, eager, fused
        if r.gpu:
            torch.cuda.empty_cache()
