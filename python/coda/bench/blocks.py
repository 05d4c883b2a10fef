"""The GPT-style block without its attention, composed from coda's ops as a user would,
against the same block in plain PyTorch (eager, torch.compile, Liger-Kernel's LayerNorm)
and against its GEMMs alone in cuBLAS. `attn` stands in for attention's output:

    qkv = LayerNorm1(x)·W_qkvᵀ + b_qkv                      (tokens, 3d)
    y   = attn·W_oᵀ + b_o + x
    z   = y + fc2(gelu_tanh(fc1(LayerNorm2(y))))            (tokens, d), ffn = 4d

Cases gpt_block_fwd_t<tokens>_d<d> (inference) and gpt_block_fwd_bwd_t<tokens>_d<d>
(the gradients of qkv and z w.r.t. x, attn and every parameter).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

import coda

from . import liger, steps
from .timing import Runner

EPS = 1e-5


def coda_block(x, attn, ln1_w, ln1_b, w_qkv, b_qkv, w_o, b_o, ln2_w, ln2_b, w1, b1, w2, b2):
    qkv = coda.ops.layernorm_linear(x, ln1_w, ln1_b, w_qkv, b_qkv, EPS)
    # o-proj's epilogue adds the residual and reduces LayerNorm2's row statistics, which
    # norm_mlp then takes instead of a pass over y
    y, stats = coda.ops.linear_residual(attn, w_o, b_o, x, "LayerNorm", EPS)
    z = coda.ops.norm_mlp(y, ln2_w, ln2_b, w1, b1, w2, b2, "LayerNorm", EPS, activation="gelu_tanh", residual=y,
                          stats=stats)
    return qkv, z


def _unfused(layer_norm: Callable, x, attn, ln1_w, ln1_b, w_qkv, b_qkv, w_o, b_o, ln2_w, ln2_b, w1, b1, w2, b2):
    qkv = F.linear(layer_norm(x, ln1_w, ln1_b, EPS), w_qkv, b_qkv)
    y = F.linear(attn, w_o, b_o) + x
    z = F.linear(F.gelu(F.linear(layer_norm(y, ln2_w, ln2_b, EPS), w1, b1), approximate="tanh"), w2, b2) + y
    return qkv, z


def _torch_layer_norm(t, weight, bias, eps):
    return F.layer_norm(t, t.shape[-1:], weight, bias, eps)


def eager_block(*args):
    return _unfused(_torch_layer_norm, *args)


def inputs(tokens: int, d: int, dtype: torch.dtype, device: str) -> list:
    """x, attn and the parameters, in coda_block's order, each requiring grad."""
    torch.manual_seed(0)
    f = 4 * d

    def r(*shape, scale=1.0):
        return steps.rand(*shape, dtype=dtype, device=device, scale=scale)

    x = steps.residual_stream(tokens, d, dtype, device)
    ln1, ln2 = steps.norm_params(d, dtype, device), steps.norm_params(d, dtype, device)
    args = [x, r(tokens, d), *ln1, r(3 * d, d, scale=d**-0.5), r(3 * d), r(d, d, scale=d**-0.5), r(d), *ln2,
            r(f, d, scale=d**-0.5), r(f), r(d, f, scale=f**-0.5), r(d)]
    return steps.trainable(args)


def output_grads(tokens: int, d: int, dtype: torch.dtype, device: str) -> list:
    """The given gradients of qkv and z."""
    return [steps.rand(tokens, 3 * d, dtype=dtype, device=device), steps.rand(tokens, d, dtype=dtype, device=device)]


def gemm_flops(tokens: int, d: int, backward: bool) -> float:
    """QKV (3d), o-proj (d), fc1 (4d), fc2 (4d back to d): 24·tokens·d² forward, three
    times that with the backward."""
    return (3.0 if backward else 1.0) * 2 * tokens * d * d * (3 + 1 + 4 + 4)


def cublas_step(args: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], backward: bool) -> Callable[[], None]:
    """The block's GEMMs alone (torch.matmul): 4 forward; with the backward each one's dgrad
    and wgrad too, 12 in all. The floor a fused block is held to."""
    x, attn, _, _, w_qkv, _, w_o, _, _, _, w1, _, w2, _ = (a.detach() for a in args)
    dqkv, dz = grads

    def step():
        torch.matmul(x, w_qkv.t())
        y = torch.matmul(attn, w_o.t())
        a = torch.matmul(y, w1.t())
        torch.matmul(a, w2.t())
        if backward:  # fc1's output gradient has a's shape: a stands in for it
            for inp, w, g in ((x, w_qkv, dqkv), (attn, w_o, dz), (y, w1, a), (a, w2, dz)):
                torch.matmul(g, w)
                torch.matmul(g.t(), inp)
    return step


def run(r: Runner, tokens: int, dims: Sequence[int], dtype: torch.dtype, device: str) -> None:
    layer_norm, why_not = liger.norm("LayerNorm", r.gpu)
    for d in dims:
        args = inputs(tokens, d, dtype, device)
        grads = output_grads(tokens, d, dtype, device)
        for backward in (False, True):
            case = f"gpt_block_{'fwd_bwd' if backward else 'fwd'}_t{tokens}_d{d}"

            def step(fn):
                return steps.forward_backward(fn, args, grads) if backward else steps.forward(fn, args)

            impls = {"coda": step(coda_block), "cublas": cublas_step(args, grads, backward),
                     "eager": step(eager_block), "compile": step(steps.compiled(eager_block))}
            if layer_norm is not None:
                impls["liger"] = step(lambda *a: _unfused(layer_norm, *a))
            else:
                r.skip(case, "liger", why_not)
            r.interleaved(case, impls, gemm_flops(tokens, d, backward), reference="eager")
        del args, grads
