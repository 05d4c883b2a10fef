"""The LM head and its cross-entropy loss in one op, with no (tokens, vocab)
logits tensor in memory (csrc/torch/loss_ops.cpp). By default the LM-head
GEMM runs by slices of the vocabulary into one reused buffer and a kernel
folds each slice into the rows' log-sum-exp and loss; the backward
recomputes the same slices and takes d loss / d logits to dX and dW, each
rounded once as torch's path rounds it (four GEMMs). recompute=False forms
the gradients in the forward, by chunks of tokens (three GEMMs, dW summed
over the chunks in float32 and rounded once in the backward);
recompute="half" forms dX, db and dW's first half of rows there (their
float32 sums fill exactly the 16-bit gradient's bytes) and recomputes the
logits of the second half's classes in the backward (three and a half
GEMMs). Extra memory: one buffer of logits and a float32 dX (recompute: 2
bytes an element of it beyond the gradient), at most 1/8 of the fp32 logits
(small problems: 16 MiB of logits and a 64 MiB dX); recompute=False adds 2
bytes a weight of float32 dW from the forward to the backward.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _kernels
from . import _checks
from ._common import autocast

__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference"]

REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}
# loss_ops.cpp's Recompute codes
RECOMPUTE = {False: 0, True: 1, "half": 2}


def _loss_and_lse(x, target, reduction):
    """The fakes' (loss, lse): per row for reduction none (code 0), else a scalar; float32."""
    loss = x.new_empty(target.shape if reduction == 0 else (), dtype=torch.float32)
    return loss, x.new_empty(math.prod(x.shape[:-1]), dtype=torch.float32)


def dw_head_rows(vocab: int) -> int:
    """The rows of W whose float32 dW the three-GEMM path keeps apart from the rest (loss_ops.cpp's Grads,
    head_rows): half, up to a multiple of 8, so that their bytes hold all of dW in 16 bits."""
    return min(vocab, ((vocab + 1) // 2 + 7) // 8 * 8)


if _kernels.available():

    @torch.library.register_fake("coda::linear_cross_entropy")
    def _(x, weight, bias, target, ignore_index, label_smoothing, softcap, z_loss, reduction, chunk, needs,
          dw_tail):
        m = math.prod(x.shape[:-1])
        grad = reduction != 0
        # the gradients of the rows' sum, dW and db in float32, and dX where D ≤ V/16 or it takes ≤ 64 MiB
        # (loss_ops.cpp's dx_in_float): the backward scales them and rounds once
        dx_dtype = torch.float32 if x.shape[-1] * 16 <= weight.shape[0] or 4 * m * x.shape[-1] <= 64 << 20 \
            else x.dtype
        v, d = weight.shape
        head = dw_head_rows(v)
        dw = grad and needs[1]
        return (*_loss_and_lse(x, target, reduction),
                x.new_empty(x.shape, dtype=dx_dtype) if grad and needs[0] else x.new_empty(0),
                x.new_empty((head, d), dtype=torch.float32) if dw else x.new_empty(0),
                x.new_empty((v - head, d), dtype=torch.float32) if dw and dw_tail else x.new_empty(0),
                x.new_empty(weight.shape[0], dtype=torch.float32) if grad and needs[2] and bias is not None
                else x.new_empty(0))

    @torch.library.register_fake("coda::linear_cross_entropy_sliced")
    def _(x, weight, bias, target, ignore_index, label_smoothing, softcap, z_loss, reduction, chunk):
        return _loss_and_lse(x, target, reduction)

    @torch.library.register_fake("coda::linear_cross_entropy_backward")
    def _(grad, x, weight, bias, target, lse, ignore_index, label_smoothing, softcap, z_loss, chunk, needs,
          first_class):
        rows = weight.shape[0] - first_class  # the classes [first_class, V) recomputed
        return (x.new_empty(x.shape) if needs[0] else x.new_empty(0),
                weight.new_empty((rows, weight.shape[1])) if needs[1] else x.new_empty(0),
                bias.new_empty(rows) if needs[2] and bias is not None else x.new_empty(0))

    @torch.library.register_fake("coda::linear_cross_entropy_loss")
    def _(x, weight, bias, target, ignore_index, label_smoothing, softcap, z_loss, reduction, chunk, recompute,
          chunk_vocab):
        return _loss_and_lse(x, target, reduction)


def linear_cross_entropy_reference(x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None, *,
                                   ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                                   softcap: Optional[float] = None, z_loss: float = 0.0,
                                   norm_weight: Optional[Tensor] = None, norm_eps: Optional[float] = None) -> Tensor:
    """The same loss from the materialized logits (F.linear, then
    F.cross_entropy on them, in float32 for 16-bit inputs, as Hugging Face's
    loss upcasts them)."""
    if norm_weight is not None:
        x = F.rms_norm(x, (x.shape[-1],), norm_weight, norm_eps)
    z = F.linear(x, weight, bias)
    z = z.float() if z.dtype in (torch.bfloat16, torch.float16) else z
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    z, t = z.reshape(-1, z.shape[-1]), target.reshape(-1).long()  # int32 targets too, as the kernel takes them
    loss = F.cross_entropy(z, t, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    if z_loss:
        valid = t != ignore_index
        loss = loss + z_loss * torch.where(valid, torch.logsumexp(z, -1), 0.0).square()
    if reduction == "none":
        return loss.reshape(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (t != ignore_index).sum()


def _check(op: str, x, weight, target, bias, reduction, label_smoothing, softcap, z_loss, norm_weight, chunk_tokens,
           chunk_vocab, recompute=True):
    _checks.x_input(x, op)
    _checks.weight("weight", weight, x.shape[-1], op, "x", x.shape)
    if weight.shape[0] == 0:
        raise ValueError(f"coda.{op}: weight has no rows (an empty vocabulary): expected (V, D) with V > 0")
    _checks.vector("bias", bias, weight.shape[0], op, " (the vocabulary: rows of weight)")
    _checks.vector("norm_weight", norm_weight, x.shape[-1], op, f" (the last dimension of x, {tuple(x.shape)})")
    if not isinstance(target, Tensor) or target.dtype not in (torch.int64, torch.int32) \
            or tuple(target.shape) != tuple(x.shape[:-1]):
        got = f"{target.dtype} {tuple(target.shape)}" if isinstance(target, Tensor) else type(target).__name__
        raise ValueError(f"coda.{op}: target must be an int64 (or int32) tensor of shape {tuple(x.shape[:-1])} "
                         f"(x's without its last dimension: one class per token), got {got}")
    if target.device != x.device:
        raise ValueError(f"coda.{op}: target is on {target.device}, expected {x.device} (the device of x)")
    if reduction not in REDUCTIONS:
        raise ValueError(f"coda.{op}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"coda.{op}: label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    if softcap is not None and (not isinstance(softcap, (int, float)) or not 0 < softcap < math.inf):
        raise ValueError(f"coda.{op}: softcap must be a positive float or None, got {softcap!r}")
    if not isinstance(z_loss, (int, float)) or not 0.0 <= z_loss < math.inf:
        raise ValueError(f"coda.{op}: z_loss must be a float >= 0, got {z_loss!r}")
    if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or chunk_tokens <= 0):
        raise ValueError(f"coda.{op}: chunk_tokens must be a positive int or None, got {chunk_tokens!r}")
    if chunk_vocab is not None and (not isinstance(chunk_vocab, int) or chunk_vocab <= 0):
        raise ValueError(f"coda.{op}: chunk_vocab must be a positive int or None, got {chunk_vocab!r}")
    if not (isinstance(recompute, bool) or (isinstance(recompute, str) and recompute == "half")):
        raise ValueError(f"coda.{op}: recompute must be True, False or 'half', got {recompute!r}")


def linear_cross_entropy(x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None, *,
                         ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                         softcap: Optional[float] = None, z_loss: float = 0.0, norm_weight: Optional[Tensor] = None,
                         norm_eps: Optional[float] = None,
                         recompute: Union[bool, str] = True, chunk_tokens: Optional[int] = None,
                         chunk_vocab: Optional[int] = None) -> Tensor:
    """cross_entropy(x·weightᵀ + bias, target) without the logits in memory.

    x: (..., D) the LM head's input; weight: (V, D), e.g. lm_head.weight or
    the tied embedding's; target: (...) int64 or int32 classes or ignore_index; bias:
    (V,) or None. ignore_index, reduction ("mean" over the rows not ignored,
    "sum", "none": x.shape[:-1]) and label_smoothing as
    torch.nn.functional.cross_entropy; softcap: logits -> softcap·tanh(logits/
    softcap) first (Gemma 2); z_loss: adds z_loss·logsumexp² per row (PaLM).
    norm_weight: an RMSNorm (γ = norm_weight, eps = norm_eps, None: machine
    epsilon as nn.RMSNorm) applied to x first, the final norm every decoder
    puts before its LM head (one pass over (tokens, D), small beside the head).

    recompute (default True): the backward recomputes the logits by slices of
    the vocabulary, so every gradient is rounded once, as torch's unfused
    path rounds it (four GEMMs). False: the forward forms the gradients of a
    mean or sum chunk by chunk and the backward scales them (three GEMMs,
    ~25% less time in the head; dW sums over the chunks in float32, held
    from the forward to the backward: 4 bytes per weight, 2 more than the
    gradient). "half": as False for all but the second half of W's rows,
    whose logits the backward recomputes (three and a half GEMMs; the first
    half's float32 dW lives in the gradient's own bytes: nothing beyond it).
    False and "half" run one backward per forward, and reduction="none"
    always recomputes (its upstream gradient is per row). chunk_vocab:
    classes per slice (recompute True, and "half"'s backward); chunk_tokens:
    tokens per chunk (False, "half"); None: at most 1/8 of the fp32 logits
    and 512 MiB at once. Returns the loss in float32.
    Gradients flow to x, weight, bias and norm_weight.
    """
    op = "linear_cross_entropy"
    _check(op, x, weight, target, bias, reduction, label_smoothing, softcap, z_loss, norm_weight, chunk_tokens,
           chunk_vocab, recompute)
    x, weight, bias, norm_weight = autocast(x, weight, bias, norm_weight)
    for name, t in (("weight", weight), ("bias", bias), ("norm_weight", norm_weight)):
        if t is not None:
            _checks.like(name, t, x, op)
    kw = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing, softcap=softcap,
              z_loss=z_loss)
    # The vocabulary needs no multiple of 8 (the logits buffer's rows are padded); D does (the GEMMs' operands).
    use = _kernels.use_kernels(op, x, _kernels.BF16_FP16, (x.shape[-1],))
    if norm_weight is not None:
        x = F.rms_norm(x, (x.shape[-1],), norm_weight, norm_eps)
    if not use:
        return linear_cross_entropy_reference(x, weight, target, bias, **kw)
    return torch.ops.coda.linear_cross_entropy_loss.default(
        x, weight, bias, target, int(ignore_index), float(label_smoothing), float(softcap or 0.0), float(z_loss),
        REDUCTIONS[reduction], int(chunk_tokens or 0), RECOMPUTE[recompute], int(chunk_vocab or 0))[0]
