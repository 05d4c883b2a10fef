"""The folded weight of a norm-GEMM, kept between forwards.

W̃ = W∘γ, s = Σ_k W̃ and t = W·β + b change only when W, γ, β or b do: once
per optimizer step in training, never in inference. Folding costs a pass over
W (for a 12288 x 4096 QKV weight about as many bytes as a LayerNorm pass over
12288 tokens), so forwards without autograd (inference) reuse it while the
tensors' versions are unchanged. With autograd on (training) and under
torch.compile the fold runs inside the op every time, so no weight update
can be missed. A write through `.data` bypasses the version counter: after
one, call coda.clear_fold_cache().
"""

from __future__ import annotations

import weakref
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from . import _kernels

_entries: Dict[int, Tuple[tuple, Tuple[Tensor, Tensor, Tensor]]] = {}


def _key(tensors) -> tuple:
    return tuple(None if t is None else (t.data_ptr(), t._version, tuple(t.shape), t.dtype) for t in tensors)


def lookup(weight: Tensor, gamma: Tensor, beta: Optional[Tensor], bias: Optional[Tensor]):
    """(W̃, s, t) for these parameters, folded now or reused; None where the kernels don't apply."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling() or not _kernels.norm_usable([weight, gamma, beta, bias], [weight.shape[1]]):
        return None
    key = _key((weight, gamma, beta, bias))
    hit = _entries.get(id(weight))
    if hit is not None and hit[0] == key:
        return hit[1]
    with torch.no_grad():
        folded = torch.ops.coda.norm_fold_weight(weight.contiguous(), gamma.contiguous(),
                                                 None if beta is None else beta.contiguous(),
                                                 None if bias is None else bias.contiguous(), True)
    if hit is None:
        weakref.finalize(weight, _entries.pop, id(weight), None)
    _entries[id(weight)] = (key, folded)
    return folded


def clear() -> None:
    _entries.clear()
