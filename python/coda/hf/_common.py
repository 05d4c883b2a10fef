"""What the model families share: how a patched forward reads its options, its return
convention, and keeping the modules a patch replaced so that unpatch can put them back."""

from __future__ import annotations

from typing import Dict, Iterable, Optional

import torch
from torch import nn

ATTR = "_coda_patch"  # on a patched model: its family's name
_ORIGINAL = "_coda_original"  # on a replacement module: the module it replaced (parameters stripped)


def forward_options(where: str, module, cache, use_cache: Optional[bool], kwargs: Dict):
    """(cache, output_hidden_states) of a patched forward call, read as Hugging Face's
    forward reads them; refuses what a patched forward does not compute.

    The cache: the one passed (cache= or past_key_values=), else a new DynamicCache
    where use_cache says so; use_cache=None takes the config's in eval mode only (a
    training step has no use for a cache, and filling one copies every layer's k and
    v), and gradient checkpointing turns it off, as in Hugging Face's models."""
    legacy = kwargs.pop("past_key_values", None)
    cache = cache if cache is not None else legacy
    config = module.config
    if use_cache is None:
        use_cache = bool(getattr(config, "use_cache", False)) and not module.training
    if remats(module):
        cache, use_cache = None, False
    if cache is None and use_cache:
        from transformers import DynamicCache
        cache = DynamicCache(config=config)
    if kwargs.pop("output_attentions", None) or getattr(config, "output_attentions", False):
        raise NotImplementedError(f"{where}: output_attentions=True is not supported by a patched model (its "
                                  f"attention is SDPA, which returns no probabilities; coda.hf.unpatch(model) gives "
                                  f"the original back)")
    if kwargs.get("shift_labels") is not None:
        raise NotImplementedError(f"{where}: shift_labels is not supported by a patched model; pass labels")
    hidden = kwargs.pop("output_hidden_states", None)
    if hidden is None:
        hidden = getattr(config, "output_hidden_states", False)
    return cache, bool(hidden)


def remats(module) -> bool:
    """Whether a forward of `module` (a HF base model) recomputes its layers in the backward."""
    return getattr(module, "gradient_checkpointing", False) and module.training and torch.is_grad_enabled()


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
