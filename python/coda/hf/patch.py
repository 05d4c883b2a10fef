"""coda.hf.patch / unpatch: find a Hugging Face model's family, hand it to that family's patch."""

from __future__ import annotations

import importlib
from typing import Union

from torch import nn

from ._common import ATTR

# transformers' class name -> the coda.hf module that patches it
FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Phi3ForCausalLM": "llama",
    "Gemma3ForCausalLM": "gemma",
    "GPT2LMHeadModel": "gpt2",
}
def _family(model) -> str:
    for cls in type(model).__mro__:
        if not cls.__module__.startswith("transformers."):
            continue  # a user's subclass: its transformers base decides
        if cls.__name__ in FAMILIES:
            return FAMILIES[cls.__name__]
    raise TypeError(f"coda.hf.patch: no patch for {type(model).__name__}; supported: {', '.join(FAMILIES)} "
                    f"(and their subclasses)")


def patch(model: nn.Module, *, lm_head_recompute: Union[bool, str] = True) -> nn.Module:
    """Run a Hugging Face causal LM's blocks as coda's fused ops, in place; returns the model.

    Supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
    Phi3ForCausalLM (coda.hf.llama), Gemma3ForCausalLM (coda.hf.gemma) and GPT2LMHeadModel
    (coda.hf.gpt2); any other class raises TypeError naming it, a
    supported class with a configuration coda cannot compute (dynamic RoPE, biased MLPs,
    ...) NotImplementedError saying what. Patching a patched model only sets
    lm_head_recompute.

    After the patch the model holds the same weights (the norms, biases, embeddings and
    unfused projections as the same tensors; fused projections as one copy each, the
    originals dropped), state_dict() has the same keys, shapes and layouts (so
    save_pretrained writes a checkpoint the unpatched class loads), and forward takes
    the same arguments: with labels it returns the loss without computing logits
    (``logits=None``), without labels the logits. Patch before creating the
    optimizer: parameters whose layout changes (fused q/k/v, gate/up; GPT-2's
    transposed Conv1D weights) are new tensors.

    Masks are transformers' own (its create_causal_mask and sliding-window mask, as an
    SDPA model builds them): padding (left or right), packed documents (position_ids
    restarting at 0 without an attention_mask, as DataCollatorWithFlattening makes
    them), sliding windows and 4-D masks compute what the unpatched model computes.
    Attention is torch's scaled_dot_product_attention, whatever attn_implementation the
    model was built with. generate() runs with the model's KV cache (use_cache=None
    reads config.use_cache in eval mode only: a training forward fills no cache), and
    output_hidden_states returns Hugging Face's tuple. Not supported
    (NotImplementedError): output_attentions, shift_labels, logits_to_keep with labels.
    Gradient checkpointing (model.gradient_checkpointing_enable()) recomputes each layer
    (non-reentrant).

    lm_head_recompute: the loss's backward (coda.ops.linear_cross_entropy's recompute;
    False: ~25% less time in the LM head, 2 bytes per weight of float32 dW held from the
    forward to the backward; "half": the forward forms all but half of dW's rows, the
    backward recomputes those, nothing held beyond the gradient); model.lm_head.recompute
    changes it later.
    """
    if not (isinstance(lm_head_recompute, bool) or lm_head_recompute == "half"):
        raise ValueError(f"coda.hf.patch: lm_head_recompute must be True, False or 'half', got {lm_head_recompute!r}")
    if getattr(model, ATTR, None) is None:
        family = _family(model)
        importlib.import_module(f"{__package__}.{family}").patch(model)
        object.__setattr__(model, ATTR, family)
    model.lm_head.recompute = lm_head_recompute
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo patch(model) in place, returning the model: the original modules and
    forward, holding the patched model's current (e.g. trained) parameter values in
    Hugging Face's layout (the norms' and other shared parameters as the same
    tensors). A model that is not patched is returned as it is."""
    family = getattr(model, ATTR, None)
    if family is None:
        return model
    importlib.import_module(f"{__package__}.{family}").unpatch(model)
    object.__delattr__(model, ATTR)
    return model


def is_patched(model: nn.Module) -> bool:
    """Whether patch(model) has run (and unpatch has not)."""
    return getattr(model, ATTR, None) is not None
