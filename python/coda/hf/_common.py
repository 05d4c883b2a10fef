"""What the model families share: the calls a patched forward refuses, its return
convention, and keeping the modules a patch replaced so that unpatch can put them back."""

from __future__ import annotations

from typing import Dict, Iterable, Optional

import torch
from torch import nn

ATTR = "_coda_patch"  # on a patched model: its family's name
_ORIGINAL = "_coda_original"  # on a replacement module: the module it replaced (parameters stripped)


def refuse_unsupported(where: str, cache, use_cache: Optional[bool], kwargs: Dict) -> None:
    """A patched forward computes whole sequences: no KV cache, no per-layer outputs."""
    cache = cache if cache is not None else kwargs.pop("past_key_values", None)
    if cache is not None or use_cache:
        raise NotImplementedError(
            f"{where}: a patched model runs whole sequences without a KV cache (use_cache=False, no cache); "
            f"for generation call coda.hf.unpatch(model) first, or generate(..., use_cache=False)")
    for name in ("output_attentions", "output_hidden_states"):
        if kwargs.pop(name, None):
            raise NotImplementedError(f"{where}: {name}=True is not supported by a patched model "
                                      f"(coda.hf.unpatch(model) gives the original back)")
    if kwargs.get("shift_labels") is not None:
        raise NotImplementedError(f"{where}: shift_labels is not supported by a patched model; pass labels")


def return_as(output, return_dict: Optional[bool], config):
    """HF's can_return_tuple: a tuple where return_dict (or the config's) is False."""
    if return_dict is None:
        return_dict = getattr(config, "return_dict", True)
    return output if return_dict else output.to_tuple()


def keep_original(new: nn.Module, old: nn.Module, shared: Iterable[nn.Module] = ()) -> None:
    """Remember `old` on `new`, outside the module tree (not in state_dict, not moved by
    .to()), its parameters unregistered: `new` holds them (the same tensors or the
    fused copies), so that no weight is kept twice. Modules in `shared` are part of
    both and keep theirs."""
    keep = {id(m) for s in shared for m in s.modules()}
    for module in old.modules():
        if id(module) not in keep:
            for name in module._parameters:
                module._parameters[name] = None
    object.__setattr__(new, _ORIGINAL, old)


def original(new: nn.Module) -> nn.Module:
    return getattr(new, _ORIGINAL)


@torch.no_grad()
def restore_parameters(old: nn.Module, state: Dict[str, torch.Tensor]) -> None:
    """Give `old` (stripped by keep_original) its parameters back from a state_dict in
    its own keys and layout, taken with keep_vars=True: a Parameter there is put back
    as it is (the same object, with its gradient and its optimizer state); a view of
    a fused parameter becomes a Parameter of its own (a contiguous copy)."""
    for key, value in state.items():
        path, _, name = key.rpartition(".")
        module = old.get_submodule(path) if path else old
        if name not in module._parameters:
            continue  # a buffer: the replacement keeps none that the original lacks
        if not isinstance(value, nn.Parameter):
            value = nn.Parameter(value.detach().clone(memory_format=torch.contiguous_format),
                                 requires_grad=value.requires_grad)
        module._parameters[name] = value


def keeps_all(logits_to_keep) -> bool:
    return isinstance(logits_to_keep, int) and logits_to_keep == 0


def keep_last(h: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """HF's logits_to_keep: an int keeps that many last positions (0: all), a tensor the positions it lists."""
    if keeps_all(logits_to_keep):
        return h
    index = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return h[:, index, :]


def patch_lm_head(model) -> None:
    """model.lm_head (an nn.Linear) -> coda.nn.LMHead on the same Parameters, whose forward
    computes the loss: the weight is read inside lm_head's own forward, where FSDP2's
    fully_shard(model.lm_head) hands it over unsharded."""
    from ..nn import LMHead
    old = model.lm_head
    if not isinstance(old, LMHead):
        new = LMHead.from_linear(old)
        keep_original(new, old)
        model.lm_head = new


def unpatch_lm_head(model) -> None:
    from ..nn import LMHead
    new = model.lm_head
    if isinstance(new, LMHead) and hasattr(new, _ORIGINAL):
        old = original(new)
        restore_parameters(old, new.state_dict(keep_vars=True))
        old.train(new.training)
        model.lm_head = old
