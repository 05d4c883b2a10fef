"""Attributes for the state_dict keys of a fused weight's parts.

A module holding one fused weight (q/k/v, gate/up) writes its state_dict under the
keys of the separate projections it replaced (``q_proj.weight``, ...). Tools that
map every key back to an attribute path, as torch.distributed.checkpoint's
get_model_state_dict / set_model_state_dict do (getattr along the dotted key),
then need ``module.q_proj.weight`` to exist: a FusedPart is that attribute.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


class FusedPart:
    """One projection of a fused weight, read-only: ``.weight`` (and ``.bias``) are its
    rows in the checkpoint's layout, computed from the fused parameter on every access
    (detached; a copy where the layout is permuted). Write through load_state_dict."""

    __slots__ = ("_get", "_name")

    def __init__(self, get: Callable[[str], Optional[torch.Tensor]], name: str):
        self._get, self._name = get, name

    @property
    def weight(self) -> torch.Tensor:
        return self._get("weight")

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return self._get("bias")

    def __repr__(self) -> str:
        return f"FusedPart({self._name}, read-only)"


def part_property(name: str, index: int, split: Callable) -> property:
    """A property giving FusedPart `name`: ``split(module, kind)`` returns the parts of
    the fused `kind` ("weight" / "bias") tensor in the checkpoint's layout, or None."""

    def get(module) -> FusedPart:
        def tensor(kind: str) -> Optional[torch.Tensor]:
            with torch.no_grad():
                parts = split(module, kind)
            return None if parts is None else parts[index]
        return FusedPart(tensor, name)

    return property(get, doc=f"{name}: read-only, the checkpoint's layout (FusedPart)")
