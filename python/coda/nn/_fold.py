"""The folded weight a norm module keeps for inference, explicitly.

A norm-GEMM's forward folds its weight (W̃ = W∘γ, s, t: one pass over W)
every call, which is what training needs: the weights change every step.
For inference, `module.fold_weights()` (or coda.nn.fold_weights(model))
folds once and keeps the result until `unfold_weights()`. It is used only
where no gradient is needed (torch.no_grad / inference_mode, or frozen
parameters); otherwise the forward folds afresh, so an optimizer step is
never missed. `load_state_dict` refolds, and so does a forward that finds
the parameters replaced, moved or changed in place (where their version
counter says so; inference tensors have none). Refolding writes into the
same tensors, so a CUDA graph captured with the fold replays with the new
values; a write the module cannot see (through `.data`, or while a graph is
replayed) needs `fold_weights()` again.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .. import ops


def _version(t: Optional[torch.Tensor]):
    if t is None:
        return None
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter
        return None


def _key(tensors):
    return tuple(None if t is None else (t.data_ptr(), t.dtype, t.device, tuple(t.shape), _version(t))
                 for t in tensors)


class FoldedNorm:
    """What a module holding a norm in front of a Linear does to keep its fold."""

    def __init__(self, module: nn.Module):
        self.folded: Optional[ops.FoldedWeight] = None
        self.key = None
        module.register_load_state_dict_post_hook(lambda m, _: self.refresh(m) if self.folded is not None else None)

    def fold(self, module) -> None:
        tensors = module.fold_inputs()
        with torch.no_grad():
            new = ops.fold_norm_weight(tensors[0], tensors[1], tensors[2], tensors[3], module.norm_kind())
        old = self.folded
        if old is not None and all(a is None and b is None or a is not None and b is not None and
                                   a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                                   for a, b in zip(old, new)):
            with torch.no_grad():  # in place: a captured CUDA graph sees the new fold
                for a, b in zip(old, new):
                    if a is not None:
                        a.copy_(b)
        else:
            self.folded = new
        self.key = _key(tensors)

    def refresh(self, module) -> None:
        self.fold(module)

    def clear(self) -> None:
        self.folded, self.key = None, None

    def for_forward(self, module, x: torch.Tensor) -> Optional[ops.FoldedWeight]:
        """The kept fold, where this forward may use it; else None."""
        if self.folded is None:
            return None
        tensors = module.fold_inputs()
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
            return None  # training: the weights may change before the next forward
        if not torch.compiler.is_compiling() and _key(tensors) != self.key:
            self.fold(module)
        if self.folded.weight.dtype != x.dtype or self.folded.weight.device != x.device:
            return None  # e.g. an fp32 module under autocast: the op folds what it casts
        return self.folded
