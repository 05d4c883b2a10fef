"""GPT2LMHeadModel as a chain of coda ops.

Each block runs as

    qkv      = layernorm_linear(h, ln_1, c_attn, stats)      ln_1 folded into c_attn's GEMM
    h, stats = linear_residual(SDPA(qkv), attn.c_proj, h)    c_proj + residual, and ln_2's statistics
    h, stats = norm_mlp(h, ln_2, mlp.c_fc, gelu, mlp.c_proj, residual=h, stats=stats, return_stats=True)

so the GEMM that writes the residual stream also reduces the next norm's row
statistics (the last block's fc2 does not: ln_f runs in torch), and the final
ln_f feeds the tied LM head's cross-entropy (coda.nn.LMHead, which calls
coda.nn.causal_lm_loss) without logits. The first block's ln_1 reduces its
own statistics (one light pass over the embeddings).

Conv1D stores its weight (in, out); coda's ops, like nn.Linear, read (out, in). The
patch transposes each of the four Conv1D weights once into a LinearConv1D, whose
state_dict() gives them back in Conv1D's (in, out) layout under the same keys and
whose load_state_dict takes that layout: a GPT-2 checkpoint loads as it is, and no
weight is kept in both layouts. Biases, norms and embeddings are the model's own tensors.

Dropout: the embedding dropout and the attention-probability dropout run (the latter
inside SDPA). The residual dropout (resid_pdrop, 0.1 in GPT-2's config) sits between
a GEMM and the residual add that its epilogue does: while it is on in training, c_proj
and fc2 write their outputs and one pass each (ops.dropout_residual) draws the mask,
adds the residual and reduces the next LayerNorm's statistics; the backward regenerates
the mask (coda's Philox draw from torch's CUDA generator: a seed fixes it, but it is not
nn.Dropout's). On the CPU path the draws are nn.Dropout's, in the unpatched block's
order, so a seed gives Hugging Face's masks. In eval mode dropout never runs and the
blocks are chains.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import ops
from ._common import (forward_options, keep_last, keep_original, keeps_all, original, patch_lm_head, remats,
                      restore_parameters, return_as, unpatch_lm_head)
from .attention import Masks, attend, sdpa_config

_CONV1D = (("attn", "c_attn"), ("attn", "c_proj"), ("mlp", "c_fc"), ("mlp", "c_proj"))


class LinearConv1D(nn.Module):
    """GPT-2's Conv1D (y = x·W + b) with W stored (out, in), as nn.Linear stores it.

    Parameters: ``weight`` (nf, nx), ``bias`` (nf,). state_dict() gives ``weight`` in
    Conv1D's (nx, nf) layout (a copy; a transposed view with keep_vars=True), and
    load_state_dict takes that layout.
    """

    def __init__(self, nx: int, nf: int, device=None, dtype=None):
        super().__init__()
        self.nx, self.nf = nx, nf
        self.weight = nn.Parameter(torch.empty(nf, nx, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(nf, device=device, dtype=dtype))
        self.register_state_dict_post_hook(_save_in_out)
        self.register_load_state_dict_pre_hook(_load_in_out)

    @classmethod
    @torch.no_grad()
    def from_conv1d(cls, conv) -> "LinearConv1D":
        """Its weight transposed (one copy), its bias the same Parameter."""
        new = cls(conv.nx, conv.nf, device="meta", dtype=conv.weight.dtype)
        new.weight = nn.Parameter(conv.weight.t().contiguous(), conv.weight.requires_grad)
        new.bias = conv.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}"


def _save_in_out(module, state_dict, prefix, local_metadata) -> None:
    key = prefix + "weight"
    if key in state_dict:
        w = state_dict[key]
        state_dict[key] = w.t() if isinstance(w, nn.Parameter) else w.t().contiguous()


def _load_in_out(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                 error_msgs) -> None:
    key = prefix + "weight"
    if key not in state_dict:
        return
    w = state_dict[key]
    if tuple(w.shape) != (module.nx, module.nf):
        error_msgs.append(f"size mismatch for {key}: expected Conv1D's (in, out) = ({module.nx}, {module.nf}), "
                          f"got {tuple(w.shape)}")
        state_dict.pop(key)
        return
    state_dict[key] = w.t().contiguous()


def check(model) -> None:
    """Raise, naming the model and what it has, where a patch would not compute what it does."""
    name, config = type(model).__name__, model.config
    if getattr(config, "add_cross_attention", False):
        raise NotImplementedError(f"coda.hf.patch: {name} has cross-attention (add_cross_attention=True): "
                                  f"not supported")
    try:
        ops.check_activation(config.activation_function, "hf.patch")
    except ValueError:
        raise NotImplementedError(f"coda.hf.patch: {name} has activation_function="
                                  f"{config.activation_function!r}, which coda's MLP does not have") from None
    for i, block in enumerate(model.transformer.h):
        for parent, child in _CONV1D:
            conv = getattr(getattr(block, parent), child)
            if type(conv).__name__ != "Conv1D":
                raise TypeError(f"coda.hf.patch: {name}.transformer.h[{i}].{parent}.{child} is a "
                                f"{type(conv).__name__}, expected transformers' Conv1D")


def patch(model):
    """Patch a GPT2LMHeadModel in place (see the module's docstring); returns it."""
    check(model)
    for block in model.transformer.h:
        for parent, child in _CONV1D:
            owner = getattr(block, parent)
            conv = getattr(owner, child)
            new = LinearConv1D.from_conv1d(conv)
            keep_original(new, conv)
            setattr(owner, child, new)
    patch_lm_head(model)
    object.__setattr__(model.transformer, _MASK_CONFIG, sdpa_config(model.config))
    model.transformer.forward = types.MethodType(_model_forward, model.transformer)
    model.forward = types.MethodType(_causal_lm_forward, model)
    return model


def unpatch(model):
    """The Conv1D modules back, with the patched model's parameter values."""
    for block in model.transformer.h:
        for parent, child in _CONV1D:
            owner = getattr(block, parent)
            new = getattr(owner, child)
            if isinstance(new, LinearConv1D):
                conv = original(new)
                restore_parameters(conv, new.state_dict(keep_vars=True))
                setattr(owner, child, conv)
    unpatch_lm_head(model)
    for m in (model.transformer, model):
        m.__dict__.pop("forward", None)
    model.transformer.__dict__.pop(_MASK_CONFIG, None)
    return model


# ---- the patched forwards

_MASK_CONFIG = "_coda_mask_config"  # on the patched GPT2Model: its config for transformers' SDPA masks


def _block(block, h, stats, mask, activation: str, want_stats: bool, cache=None):
    """-> (h, the next ln_1's statistics of h, or None)."""
    attn, mlp, ln_1, ln_2 = block.attn, block.mlp, block.ln_1, block.ln_2
    training = block.training
    qkv = ops.layernorm_linear(h, ln_1.weight, ln_1.bias, attn.c_attn.weight, attn.c_attn.bias, ln_1.eps,
                               stats=stats)
    q, k, v = (t.unflatten(-1, (-1, attn.head_dim)) for t in qkv.split(attn.split_size, -1))
    a = attend(q, k, v, attn.scaling, mask, attn.attn_dropout.p if training else 0.0, cache, attn.layer_idx)
    if training and (attn.resid_dropout.p > 0 or mlp.dropout.p > 0):
        return _block_with_dropout(block, h, a, activation, want_stats)
    h, stats = ops.linear_residual(a, attn.c_proj.weight, attn.c_proj.bias, h, "LayerNorm", ln_2.eps)
    out = ops.norm_mlp(h, ln_2.weight, ln_2.bias, mlp.c_fc.weight, mlp.c_fc.bias, mlp.c_proj.weight,
                       mlp.c_proj.bias, "LayerNorm", ln_2.eps, activation, residual=h, stats=stats,
                       return_stats=want_stats)
    return out if want_stats else (out, None)


def _block_with_dropout(block, h, a, activation: str, want_stats: bool):
    """The rest of a training block whose residual dropout is on: dropout sits between
    each GEMM and the residual add its epilogue would do, so each GEMM writes its output
    and one pass (dropout_residual) draws the mask, adds the residual and reduces the next
    LayerNorm's statistics (ln_2's, then the next block's ln_1's). On the reference path the
    draws are nn.Dropout's, from the global RNG in the unpatched block's order."""
    attn, mlp, ln_2 = block.attn, block.mlp, block.ln_2
    h, stats = ops.dropout_residual(ops.linear(a, attn.c_proj.weight, attn.c_proj.bias), h, attn.resid_dropout.p,
                                    "LayerNorm", ln_2.eps)
    m = ops.norm_mlp(h, ln_2.weight, ln_2.bias, mlp.c_fc.weight, mlp.c_fc.bias, mlp.c_proj.weight, mlp.c_proj.bias,
                     "LayerNorm", ln_2.eps, activation, stats=stats)
    if want_stats:
        return ops.dropout_residual(m, h, mlp.dropout.p, "LayerNorm", ln_2.eps)
    return ops.dropout_residual(m, h, mlp.dropout.p), None


def _run(tr, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, cache, want_hidden: bool,
         where: str):
    """Embeddings and the blocks: (the last block's output, before ln_f; the hidden
    states Hugging Face's output_hidden_states returns but the last, or None)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError(f"{where}: pass exactly one of input_ids and inputs_embeds")
    if input_ids is not None:
        input_ids = input_ids.view(-1, input_ids.shape[-1])
    h = tr.wte(input_ids) if inputs_embeds is None else inputs_embeds
    batch, seq = h.shape[:2]
    if position_ids is None:
        past = cache.get_seq_length() if cache is not None else 0
        position_ids = torch.arange(past, past + seq, device=h.device)[None]
    embeds = h
    h = h + tr.wpe(position_ids)
    if token_type_ids is not None:
        h = h + tr.wte(token_type_ids.view(-1, seq))
    h = tr.drop(h)
    if attention_mask is not None and torch.is_tensor(attention_mask) and attention_mask.dim() < 4:
        attention_mask = attention_mask.view(batch, -1)
    mask = Masks(getattr(tr, _MASK_CONFIG), embeds, attention_mask, cache, position_ids, where)(None)
    if cache is not None and hasattr(cache, "self_attention_cache"):
        cache = cache.self_attention_cache  # an EncoderDecoderCache (there is no cross-attention here)
    activation = tr.config.activation_function
    remat = remats(tr)
    hidden = [] if want_hidden else None
    stats = None
    for i, block in enumerate(tr.h):
        if hidden is not None:
            hidden.append(h)
        # norm_mlp reduces statistics with its own ln_2's eps: the next ln_1 takes them where its eps is the same
        want = i + 1 < len(tr.h) and tr.h[i + 1].ln_1.eps == block.ln_2.eps
        if remat:
            h, stats = checkpoint(_block, block, h, stats, mask, activation, want, use_reentrant=False)
        else:
            h, stats = _block(block, h, stats, mask, activation, want, cache)
    return h, hidden


def _hidden_states(hidden, normed):
    """Hugging Face's output_hidden_states: the embeddings and each block's output, the last one after ln_f."""
    return None if hidden is None else (*hidden, normed)


def _refuse_cross_attention(where, encoder_hidden_states) -> None:
    if encoder_hidden_states is not None:
        raise NotImplementedError(f"{where}: encoder_hidden_states (cross-attention) is not supported")


def _model_forward(self, input_ids=None, cache=None, attention_mask=None, token_type_ids=None, position_ids=None,
                   inputs_embeds=None, encoder_hidden_states=None, encoder_attention_mask=None, use_cache=None,
                   return_dict=None, **kwargs):
    from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions
    where = f"coda.hf patched {type(self).__name__}"
    cache, want_hidden = forward_options(where, self, cache, use_cache, kwargs)
    _refuse_cross_attention(where, encoder_hidden_states)
    h, hidden = _run(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, cache, want_hidden,
                     where)
    h = self.ln_f(h)
    out = BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=h, cache=cache,
                                                    hidden_states=_hidden_states(hidden, h))
    return return_as(out, return_dict, self.config)


def _causal_lm_forward(self, input_ids=None, cache=None, attention_mask=None, token_type_ids=None, position_ids=None,
                       inputs_embeds=None, encoder_hidden_states=None, encoder_attention_mask=None, labels=None,
                       use_cache=None, logits_to_keep=0, return_dict=None, **kwargs):
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions
    where = f"coda.hf patched {type(self).__name__}"
    tr = self.transformer
    cache, want_hidden = forward_options(where, tr, cache, use_cache, kwargs)
    _refuse_cross_attention(where, encoder_hidden_states)
    h, hidden = _run(tr, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, cache, want_hidden,
                     where)
    h = tr.ln_f(h)
    hidden = _hidden_states(hidden, h)
    if labels is None:
        logits = self.lm_head(keep_last(h, logits_to_keep))
        out = CausalLMOutputWithCrossAttentions(logits=logits, cache=cache, hidden_states=hidden)
        return return_as(out, return_dict, self.config)
    if not keeps_all(logits_to_keep):
        raise NotImplementedError(f"{where}: logits_to_keep with labels is not supported (the loss covers every "
                                  f"position)")
    loss = self.lm_head(h, labels, ignore_index=kwargs.get("ignore_index", -100),
                        num_items_in_batch=kwargs.get("num_items_in_batch"))
    return return_as(CausalLMOutputWithCrossAttentions(loss=loss, cache=cache, hidden_states=hidden), return_dict,
                     self.config)
