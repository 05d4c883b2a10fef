"""The causal-LM loss of a model's last hidden states, without its logits: a function and
the LM head module that computes it in its own forward."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops

Norm = Union[None, nn.Module, Tuple[Tensor, Optional[float]]]


def causal_lm_loss(hidden: Tensor, weight: Tensor, labels: Tensor, *, norm: Norm = None,
                   bias: Optional[Tensor] = None, ignore_index: int = -100, num_items_in_batch=None,
                   softcap: Optional[float] = None, recompute: Union[bool, str] = True) -> Tensor:
    """Next-token cross-entropy of Norm(hidden)·weightᵀ (+ bias) against labels, as
    Hugging Face's causal LMs compute it, through coda.ops.linear_cross_entropy: the
    (tokens, vocab) logits are never materialized.

    hidden: (B, S, D) (or (S, D)), the last decoder layer's output, before the final
    norm when `norm` is given; weight: (V, D), the LM head's (tied: the embedding's);
    labels: (B, S) int64, the token ids themselves (``labels = input_ids`` as in HF):
    position t is scored against labels[t + 1], the last position of each row against
    nothing (the labels are shifted left and padded with ignore_index on the right;
    hidden is neither shifted nor copied). Tokens labelled ignore_index do not count.

    norm: None (hidden is already normalized); an ``nn.RMSNorm`` or a pair
    ``(weight, eps)`` meaning RMSNorm (LLaMA's final norm), applied inside the op;
    or any other module (e.g. GPT-2's nn.LayerNorm), applied in torch first. softcap: tanh
    soft-capping of the logits (Gemma 2), or None. recompute:
    linear_cross_entropy's (True: gradients rounded as torch's, four GEMMs; False:
    three GEMMs, dW summed over chunks in float32: 2 bytes per weight beyond the
    gradient; "half": three and a half GEMMs, nothing beyond the gradient).

    Returns the mean over the counted tokens; with ``num_items_in_batch`` (an int or
    a tensor: the counted tokens of the whole accumulated batch, as HF's Trainer
    passes it) the sum divided by it instead, so that the gradients of a batch
    accumulated over several micro-batches equal those of the batch in one step.
    float32 for any dtype of hidden.
    """
    if not isinstance(labels, Tensor) or labels.shape != hidden.shape[:-1]:
        got = tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
        raise ValueError(f"coda.nn.causal_lm_loss: labels must have shape {tuple(hidden.shape[:-1])} "
                         f"(hidden's without its last dimension), got {got}")
    norm_weight, norm_eps = None, None
    if isinstance(norm, tuple):
        norm_weight, norm_eps = norm
        if not isinstance(norm_weight, Tensor):
            raise ValueError("coda.nn.causal_lm_loss: norm=(weight, eps) needs the RMSNorm's weight tensor")
    elif isinstance(norm, nn.RMSNorm):
        norm_weight, norm_eps = norm.weight, norm.eps
    elif norm is not None:
        hidden = norm(hidden)

    # labels[t + 1] is the target of position t; the last position of each row has none
    target = F.pad(labels[..., 1:], (0, 1), value=ignore_index)
    loss_fn = getattr(ops, "linear_cross_entropy", None)
    if loss_fn is None:
        raise RuntimeError("coda.nn.causal_lm_loss needs coda.ops.linear_cross_entropy, which this build of coda "
                           "lacks")
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = loss_fn(hidden, weight, target.to(hidden.device), bias, ignore_index=ignore_index, reduction=reduction,
                   softcap=softcap, norm_weight=norm_weight, norm_eps=norm_eps, recompute=recompute)
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


class LMHead(nn.Linear):
    """A model's LM head (an nn.Linear: ``weight`` (V, D), optional ``bias``, the same
    state_dict) whose forward also takes the labels and then returns the causal-LM loss
    (causal_lm_loss) instead of the logits.

    forward(hidden) -> logits, as nn.Linear; forward(hidden, labels, norm=..., **loss_args)
    -> the loss. The loss reads the weight inside this module's forward, which
    is where wrappers that shard parameters (FSDP2's fully_shard(lm_head)) hand it over
    whole. ``recompute`` (an attribute: True, False or "half";
    default True) is the loss's (causal_lm_loss).
    """

    recompute: Union[bool, str] = True

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> "LMHead":
        """An LMHead holding `linear`'s Parameters (the same objects: ties stay tied)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                  dtype=linear.weight.dtype)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def forward(self, hidden: Tensor, labels: Optional[Tensor] = None, *, norm: Norm = None,
                **loss_args) -> Tensor:
        if labels is None:
            if norm is not None or loss_args:
                raise ValueError("coda.nn.LMHead: norm and the loss's arguments need labels")
            return F.linear(hidden, self.weight, self.bias)
        loss_args.setdefault("recompute", self.recompute)
        return causal_lm_loss(hidden, self.weight, labels, norm=norm, bias=self.bias, **loss_args)
