"""LLaMA-family causal LMs (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM, Phi3ForCausalLM) as chains of coda ops.

Each decoder layer becomes a DecoderLayer:

    q, k, v  = RMSNormQKVRoPE(h, positions, stats)    input_layernorm, q/k/v (+ bias), RoPE: one GEMM
    h, stats = linear_residual(SDPA(q, k, v), o_proj, h)   o_proj + residual, and h's RMSNorm statistics
    h, stats = SwiGLUMLP(h, residual=h, stats=stats, return_stats=True)
                                                        post_attention_layernorm, gate/up, SwiGLU, down
                                                        + residual, and the next norm's statistics

so every GEMM that writes the residual stream also reduces the statistics of the norm
after it, and that norm's GEMM takes them (`stats=`) instead of a pass over h: within
a layer and across layers, where the next layer's RMSNormQKVRoPE takes the MLP's. The
final norm is folded into the LM head's cross-entropy (coda.nn.causal_lm_loss).
Backward: each op's backward treats the statistics as functions of h, so gradients are
those of the unfused model.

Parameters: the norms', o_proj's and down_proj's are the model's own tensors (the same
Parameter objects); q/k/v become one pair-permuted [q; k; v] weight and gate/up one
interleaved weight, made once at patch time, after which the original projections
keep no copy. state_dict() has Hugging Face's keys and layouts.
"""

from __future__ import annotations

import types
from typing import Optional, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import ops
from ..nn import FusedPart, RMSNormQKVRoPE, SwiGLUMLP, norm_eps, norm_gamma
from ._common import (forward_options, keep_last, keep_original, keeps_all, original, patch_lm_head, remats,
                      restore_parameters, return_as, unpatch_lm_head)
from .attention import Masks, attend, sdpa_config

# coda's key prefix inside a DecoderLayer -> Hugging Face's
_RENAMES = (("self_attn.qkv.norm.", "input_layernorm."), ("self_attn.qkv.q_proj.", "self_attn.q_proj."),
            ("self_attn.qkv.k_proj.", "self_attn.k_proj."), ("self_attn.qkv.v_proj.", "self_attn.v_proj."),
            ("mlp.norm.", "post_attention_layernorm."))


class SelfAttention(nn.Module):
    """input_layernorm -> q, k, v -> RoPE (``qkv``, one GEMM), causal SDPA, and
    ``o_proj`` + residual (linear_residual), which also returns the next norm's row
    statistics. forward(h, positions, stats, mask, next_eps, cache) -> (h + o_proj(attn), stats);
    a KV cache gets this layer's (layer_idx's) k and v.

    Qwen3's ``q_norm`` and ``k_norm`` (an RMSNorm of each q and k head, between the
    projection and RoPE; Hugging Face's modules): ``qkv`` then rotates nothing (its
    frequencies are 0) and the norms and RoPE run after it (QKNormRoPE)."""

    def __init__(self, qkv: RMSNormQKVRoPE, o_proj: nn.Linear, scaling: float, dropout: float,
                 sliding_window: Optional[int], layer_idx: int, q_norm: Optional[nn.Module] = None,
                 k_norm: Optional[nn.Module] = None, rope: Optional["QKNormRoPE"] = None):
        super().__init__()
        self.qkv, self.o_proj = qkv, o_proj
        if q_norm is not None:
            self.q_norm, self.k_norm, self.rope = q_norm, k_norm, rope
        self.scaling, self.dropout, self.sliding_window = scaling, dropout, sliding_window
        self.layer_idx = layer_idx

    def forward(self, h, positions, stats, mask, next_eps, cache=None):
        a = self.attention(h, positions, stats, mask, cache)
        return ops.linear_residual(a, self.o_proj.weight, self.o_proj.bias, h, "RMSNorm", next_eps)

    def attention(self, h, positions, stats, mask, cache=None):
        """The attention's output before o_proj, (..., heads·head_dim)."""
        q, k, v = self.qkv(h, positions, stats)
        if hasattr(self, "q_norm"):
            q, k = self.rope(q, k, positions, self.q_norm, self.k_norm)
        return attend(q, k, v, self.scaling, mask, self.dropout if self.training else 0.0, cache, self.layer_idx)

    # Hugging Face's attribute paths of the state_dict keys (q_proj.weight, ...), for tools that
    # resolve keys to attributes (torch.distributed.checkpoint's get_model_state_dict)
    q_proj = property(lambda self: self.qkv.q_proj)
    k_proj = property(lambda self: self.qkv.k_proj)
    v_proj = property(lambda self: self.qkv.v_proj)
    # Phi-3's checkpoint keeps them as one [q; k; v]
    qkv_proj = property(lambda self: FusedPart(lambda kind: _cat(self.qkv._parts(kind)), "qkv_proj"))

    def extra_repr(self) -> str:
        return (f"layer_idx={self.layer_idx}, scaling={self.scaling:.6g}, dropout={self.dropout}, "
                f"sliding_window={self.sliding_window}")


class QKNormRoPE(nn.Module):
    """Qwen3's per-head RMSNorm of q and k, then RoPE, on q and k in coda's pair layout
    (each head's dims j and j + head_dim/2 adjacent, as RMSNormQKVRoPE writes them): the
    norms' weights are read in that order, and pair j rotates by inv_freq_j, with the
    angles as Hugging Face's rotary embedding computes them (float32 position ·
    inv_freq, cos and sin in the activations' dtype). inv_freq (head_dim/2,) is kept
    as the int32 bits of its float32 values (model.to(dtype) leaves them exact), outside
    the state_dict. zero_centered: the norms scale by 1 + weight (Gemma's)."""

    def __init__(self, inv_freq: torch.Tensor, zero_centered: bool = False):
        super().__init__()
        self.register_buffer("inv_freq_bits", inv_freq.to(torch.float32).view(torch.int32), persistent=False)
        self.zero_centered = zero_centered

    def forward(self, q, k, positions, q_norm, k_norm):
        inv_freq = self.inv_freq_bits.view(torch.float32)
        return (ops.head_norm_rope(q, self._weight(q_norm), positions, inv_freq, norm_eps(q_norm)),
                ops.head_norm_rope(k, self._weight(k_norm), positions, inv_freq, norm_eps(k_norm)))

    def _weight(self, norm):
        return norm_gamma(norm.weight, self.zero_centered).unflatten(0, (2, -1)).t().flatten()  # -> pair order


class GateUpMLP(SwiGLUMLP):
    """Phi-3's MLP: a SwiGLUMLP whose checkpoint keeps gate and up as one gate_up_proj,
    the rows [gate; up] (DecoderLayer's state_dict hooks fuse and split them)."""

    gate_up_proj = property(lambda self: FusedPart(
        lambda kind: _cat(ops.split_gate_up(self.gate_up_weight.detach())) if kind == "weight" else None,
        "gate_up_proj"))


def _cat(parts):
    return None if parts is None else torch.cat(list(parts))


class DecoderLayer(nn.Module):
    """A LLaMA decoder layer as coda ops: ``self_attn`` (SelfAttention) and ``mlp``
    (coda.nn.SwiGLUMLP with the post-attention RMSNorm in front).

    forward(h, positions, stats=None, mask=None, cache=None) -> (h, stats): stats in and
    out are the float32 (..., 2) RMSNorm row statistics of the residual stream, in from
    the layer before (None: computed here), out for the layer after. mask: None (causal)
    or coda.hf.attention.Masks's; cache: a KV cache (transformers' Cache) or None.

    state_dict() has the keys and layouts of the Hugging Face layer it replaced
    (input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
    mlp.{gate,up,down}_proj; Phi-3's self_attn.qkv_proj and mlp.gate_up_proj where
    the layer's keys have them), in its order; load_state_dict takes them.
    """

    renames = _RENAMES

    def __init__(self, self_attn: SelfAttention, mlp: SwiGLUMLP, hf_keys: Sequence[str]):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.hf_keys = tuple(hf_keys)
        self.fused_keys = _QKV in self.hf_keys
        self.register_state_dict_post_hook(_save_hf_keys)
        self.register_load_state_dict_pre_hook(_load_hf_keys)

    # the norms under Hugging Face's names, as the state_dict keys them (see SelfAttention.q_proj)
    input_layernorm = property(lambda self: self.self_attn.qkv.norm)
    post_attention_layernorm = property(lambda self: self.mlp.norm)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, stats: Optional[torch.Tensor] = None,
                mask: Optional[torch.Tensor] = None, cache=None):
        if stats is not None and stats.dtype != torch.float32:
            # a wrapper cast them (FSDP2's MixedPrecisionPolicy casts every floating-point forward
            # input by default): rounded statistics would shift the norm, so this layer reduces its own
            stats = None
        h, stats = self.self_attn(h, positions, stats, mask, self.mlp.norm.eps, cache)
        return self.mlp(h, residual=h, stats=stats, return_stats=True)


def _rename(local: str, pairs) -> str:
    for old, new in pairs:
        if local.startswith(old):
            return new + local[len(old):]
    return local


# Phi-3's fused keys -> the separate ones they hold, in order
_QKV, _GATE_UP = "self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"
_FUSED = ((_QKV, ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
          (_GATE_UP, ("mlp.gate_proj.weight", "mlp.up_proj.weight")))


def _save_hf_keys(module, state_dict, prefix, local_metadata) -> None:
    mine = [(k, state_dict.pop(k)) for k in list(state_dict) if k.startswith(prefix)]
    named = {_rename(k[len(prefix):], module.renames): v for k, v in mine}
    if module.fused_keys:
        for fused, parts in _FUSED:
            named[fused] = torch.cat([named.pop(p) for p in parts])
    order = {k: i for i, k in enumerate(module.hf_keys)}
    for local in sorted(named, key=lambda k: order.get(k, len(order))):  # HF's order; anything new after it
        state_dict[prefix + local] = named[local]


def _load_hf_keys(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                  error_msgs) -> None:
    if module.fused_keys:
        sizes = (module.self_attn.qkv.sizes, (module.mlp.gate_up_weight.shape[0] // 2,) * 2)
        for (fused, parts), split in zip(_FUSED, sizes):
            if prefix + fused in state_dict:
                t = state_dict.pop(prefix + fused)
                if t.shape[0] != sum(split):
                    error_msgs.append(f"size mismatch for {prefix + fused}: {tuple(t.shape)}, expected {sum(split)} "
                                      f"rows")
                    continue
                state_dict.update((prefix + p, part) for p, part in zip(parts, t.split(split)))
    back = tuple((new, old) for old, new in module.renames)
    for key in [k for k in state_dict if k.startswith(prefix)]:
        local = _rename(key[len(prefix):], back)
        if local != key[len(prefix):]:
            state_dict[prefix + local] = state_dict.pop(key)


# ---- checks, before anything is changed

def _rope(model) -> tuple:
    """(inv_freq or None, theta) of the model's rotary embedding, where coda's RoPE computes the same.

    The frequencies come from the config, not from the model's inv_freq buffer, which
    model.to(torch.bfloat16) rounds to bf16 (angles off by radians at a few thousand
    positions): "default" RoPE as None (coda computes theta^(-2i/head_dim) in float64),
    others (linear, llama3) from Hugging Face's own init function, in float32."""
    rotary = model.model.rotary_emb
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type in ("dynamic", "longrope", "yarn") or float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        raise NotImplementedError(f"coda.hf.patch: {type(model).__name__} uses RoPE type {rope_type!r}, whose "
                                  f"frequencies change with the sequence length or whose cos/sin are scaled; coda's "
                                  f"RoPE takes fixed frequencies (default, linear, llama3)")
    config = model.config
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    if rope_type == "default":
        return None, float(theta)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.to(torch.float64), float(theta)


def check(model) -> None:
    """Raise, naming the model and what it has, where a patch would not compute what it does."""
    name = type(model).__name__
    config, base = model.config, model.model
    for i, layer in enumerate(base.layers):
        attn, mlp = layer.self_attn, layer.mlp
        where = f"coda.hf.patch: {name}.model.layers[{i}]"
        if hasattr(attn, "q_norm") != hasattr(attn, "k_norm"):
            raise NotImplementedError(f"{where} has only one of q_norm and k_norm: not supported")
        if hasattr(attn, "q_norm"):
            for part in ("q_norm", "k_norm"):
                norm = getattr(attn, part)
                if getattr(norm, "weight", None) is None or tuple(norm.weight.shape) != (attn.head_dim,) \
                        or not hasattr(norm, "variance_epsilon"):
                    raise NotImplementedError(f"{where}.self_attn.{part} is not an RMSNorm over head_dim "
                                              f"({attn.head_dim}) with a weight: not supported")
        biases = [b is not None for b in _projections(attn, config)[1]]
        if any(biases) and not all(biases):
            raise NotImplementedError(f"{where}: q/k/v biases must be all present or all absent, got {biases}")
        if _gate_up(mlp)[1] or mlp.down_proj.bias is not None:
            raise NotImplementedError(f"{where}: biased MLP projections (mlp_bias=True) are not supported")
        window = _window(attn, config)
        if window is not None and window != getattr(config, "sliding_window", None):
            raise NotImplementedError(f"{where}: its sliding window {window} is not the config's "
                                      f"{getattr(config, 'sliding_window', None)}, which transformers' mask takes")
        if attn.head_dim % 2:
            raise NotImplementedError(f"{where}: head_dim {attn.head_dim} is odd; RoPE rotates pairs")
        eps = {layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm.variance_epsilon,
               base.norm.variance_epsilon}
        if len(eps) != 1:
            raise NotImplementedError(f"{where}: its norms have different eps {sorted(eps)}; the statistics one GEMM "
                                      f"hands to the next norm are computed with that norm's eps")
    try:
        ops.check_activation(config.hidden_act, "hf.patch", gated=True)
    except ValueError:
        raise NotImplementedError(f"coda.hf.patch: {name} has hidden_act={config.hidden_act!r}; coda's gated MLP "
                                  f"takes silu (SwiGLU) or gelu / gelu_tanh (GeGLU)") from None
    rope = getattr(config, "rope_parameters", None) or {}
    if float(rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise NotImplementedError(f"coda.hf.patch: {name} rotates only part of each head (partial_rotary_factor "
                                  f"{rope.get('partial_rotary_factor')}); coda's RoPE rotates all of it")
    if float(getattr(config, "resid_pdrop", 0.0) or 0.0) > 0:
        raise NotImplementedError(f"coda.hf.patch: {name} has resid_pdrop={config.resid_pdrop}: a dropout between "
                                  f"the GEMMs and the residual adds their epilogues do (train with resid_pdrop=0)")
    _rope(model)


def _projections(attn, config):
    """((q, k, v) weights, (q, k, v) biases or Nones, (heads, kv_heads)) of a layer's
    attention, in the checkpoint's layout: Phi-3 keeps them as one qkv_proj."""
    hd = attn.head_dim
    if hasattr(attn, "qkv_proj"):
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        sizes = (heads * hd, kv_heads * hd, kv_heads * hd)
        fused = attn.qkv_proj
        biases = (None,) * 3 if fused.bias is None else fused.bias.split(sizes)
        return fused.weight.split(sizes), biases, (heads, kv_heads)
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    return (q.weight, k.weight, v.weight), (q.bias, k.bias, v.bias), (q.weight.shape[0] // hd, k.weight.shape[0] // hd)


def _gate_up(mlp):
    """((gate, up) weights, whether either has a bias): Phi-3 keeps them as one gate_up_proj, [gate; up]."""
    if hasattr(mlp, "gate_up_proj"):
        return mlp.gate_up_proj.weight.chunk(2), mlp.gate_up_proj.bias is not None
    return (mlp.gate_proj.weight, mlp.up_proj.weight), mlp.gate_proj.bias is not None or mlp.up_proj.bias is not None


def _window(attn, config) -> Optional[int]:
    """The layer's sliding window: Qwen2's attention has one per layer (None for full attention), Mistral's the config's."""
    return getattr(attn, "sliding_window", getattr(config, "sliding_window", None))


# ---- the patch

@torch.no_grad()
def _decoder_layer(layer, config, inv_freq: Optional[torch.Tensor], theta: float) -> DecoderLayer:
    """The DecoderLayer computing what `layer` (a HF decoder layer) computes, on its tensors."""
    attn, mlp = layer.self_attn, layer.mlp
    weights, biases, (heads, kv_heads) = _projections(attn, config)
    w = weights[0]
    rope = None
    if hasattr(attn, "q_norm"):  # Qwen3: the norms come between the projection and RoPE, which runs after them
        half = attn.head_dim // 2
        full = inv_freq if inv_freq is not None else theta ** (-torch.arange(half, dtype=torch.float64) / half)
        rope = QKNormRoPE(full).to(w.device)
        inv_freq = torch.zeros(half, dtype=torch.float64)
    # built on the meta device: no weights drawn (the global RNG is left as it was), none allocated twice
    qkv = RMSNormQKVRoPE(w.shape[1], heads, kv_heads, attn.head_dim, theta, layer.input_layernorm.variance_epsilon,
                         bias=biases[0] is not None, inv_freq=inv_freq, device="meta", dtype=w.dtype)
    qkv.norm.weight = layer.input_layernorm.weight
    qkv.qkv_weight = nn.Parameter(qkv.permute(torch.cat(weights)), w.requires_grad)
    if biases[0] is not None:
        qkv.qkv_bias = nn.Parameter(qkv.permute(torch.cat(biases)), biases[0].requires_grad)
    freq = ops.rope_frequencies(attn.head_dim, heads, kv_heads, theta, inv_freq=inv_freq)
    qkv.freq_bits = freq.view(torch.int32).to(w.device)
    self_attn = SelfAttention(qkv, attn.o_proj, float(attn.scaling), float(getattr(attn, "attention_dropout", 0.0)),
                              _window(attn, config), attn.layer_idx, getattr(attn, "q_norm", None),
                              getattr(attn, "k_norm", None), rope)

    (g, u), _ = _gate_up(mlp)
    kind = GateUpMLP if hasattr(mlp, "gate_up_proj") else SwiGLUMLP
    new_mlp = kind(g.shape[1], g.shape[0], config.hidden_act, normalization="RMSNorm",
                   eps=layer.post_attention_layernorm.variance_epsilon, device="meta", dtype=g.dtype)
    new_mlp.norm.weight = layer.post_attention_layernorm.weight
    new_mlp.gate_up_weight = nn.Parameter(ops.interleave_gate_up(g, u), g.requires_grad)
    new_mlp.down_proj = mlp.down_proj
    new = DecoderLayer(self_attn, new_mlp, layer.state_dict(keep_vars=True).keys())
    new.train(layer.training)
    return new


def patch(model):
    """Patch a LLaMA-family causal LM in place (see the module's docstring); returns it."""
    check(model)
    inv_freq, theta = _rope(model)
    return patch_layers(model, lambda layer: _decoder_layer(layer, model.config, inv_freq, theta))


def patch_layers(model, make, zero_centered: bool = False):
    """Each decoder layer -> make(layer), the LM head and the forwards: the patch every family
    of this shape (model.model.layers, .norm, .embed_tokens; model.lm_head) shares.
    zero_centered: the final norm scales by 1 + weight (Gemma's)."""
    base = model.model
    for i, layer in enumerate(base.layers):
        new = make(layer)
        mine = {id(m) for m in new.modules()}
        keep_original(new, layer, shared=[m for m in layer.modules() if id(m) in mine])  # o_proj, down_proj, ...
        base.layers[i] = new  # the fused copies replace q/k/v and gate/up layer by layer: no peak of two
    patch_lm_head(model)
    object.__setattr__(base, _MASK_CONFIG, sdpa_config(model.config))
    object.__setattr__(base, _ZERO_CENTERED, zero_centered)
    base.forward = types.MethodType(_model_forward, base)
    model.forward = types.MethodType(_causal_lm_forward, model)
    return model


def unpatch(model):
    """The Hugging Face layers back, with the patched model's parameter values."""
    base = model.model
    for i, layer in enumerate(base.layers):
        if isinstance(layer, DecoderLayer):
            old = original(layer)
            restore_parameters(old, layer.state_dict(keep_vars=True))
            old.train(layer.training)
            base.layers[i] = old
    unpatch_lm_head(model)
    for m in (base, model):
        m.__dict__.pop("forward", None)
    base.__dict__.pop(_MASK_CONFIG, None)
    base.__dict__.pop(_ZERO_CENTERED, None)
    return model


# ---- the patched forwards

_MASK_CONFIG = "_coda_mask_config"  # on the patched base model: its config for transformers' SDPA masks
_ZERO_CENTERED = "_coda_zero_centered"  # on the patched base model: whether its final norm scales by 1 + weight


def _run(base, input_ids, attention_mask, position_ids, inputs_embeds, cache, want_hidden: bool, where: str):
    """Embeddings and the decoder layers: (h, the hidden states Hugging Face's
    output_hidden_states returns but the last, or None)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError(f"{where}: pass exactly one of input_ids and inputs_embeds")
    h = base.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
    if position_ids is None:
        past = cache.get_seq_length() if cache is not None else 0
        position_ids = torch.arange(past, past + h.shape[1], device=h.device)[None]
    masks = Masks(getattr(base, _MASK_CONFIG), h, attention_mask, cache, position_ids, where)
    remat = remats(base)
    hidden = [] if want_hidden else None
    stats = None
    for layer in base.layers:
        if hidden is not None:
            hidden.append(h)
        mask = masks(layer.self_attn.sliding_window)
        if remat:
            h, stats = checkpoint(layer, h, position_ids, stats, mask, use_reentrant=False)
        else:
            h, stats = layer(h, position_ids, stats, mask, cache)
    return h, hidden


def _model_forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                   use_cache=None, return_dict=None, **kwargs):
    from transformers.modeling_outputs import BaseModelOutputWithPast
    where = f"coda.hf patched {type(self).__name__}"
    cache, want_hidden = forward_options(where, self, cache, use_cache, kwargs)
    h, hidden = _run(self, input_ids, attention_mask, position_ids, inputs_embeds, cache, want_hidden, where)
    h = self.norm(h)
    out = BaseModelOutputWithPast(last_hidden_state=h, cache=cache, hidden_states=_hidden_states(hidden, h))
    return return_as(out, return_dict, self.config)


def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                       labels=None, use_cache=None, logits_to_keep=0, return_dict=None, **kwargs):
    from transformers.modeling_outputs import CausalLMOutputWithPast
    where = f"coda.hf patched {type(self).__name__}"
    cache, want_hidden = forward_options(where, self.model, cache, use_cache, kwargs)
    h, hidden = _run(self.model, input_ids, attention_mask, position_ids, inputs_embeds, cache, want_hidden, where)
    norm = self.model.norm
    softcap = getattr(self.config, "final_logit_softcapping", None)
    normed = norm(h) if labels is None or want_hidden else None
    if labels is None:
        logits = self.lm_head(keep_last(normed, logits_to_keep))
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        out = CausalLMOutputWithPast(logits=logits, cache=cache, hidden_states=_hidden_states(hidden, normed))
        return return_as(out, return_dict, self.config)
    if not keeps_all(logits_to_keep):
        raise NotImplementedError(f"{where}: logits_to_keep with labels is not supported (the loss covers every "
                                  f"position)")
    gamma = norm_gamma(norm.weight, getattr(self.model, _ZERO_CENTERED))
    loss = self.lm_head(h, labels, norm=(gamma, norm_eps(norm)), ignore_index=kwargs.get("ignore_index", -100),
                        num_items_in_batch=kwargs.get("num_items_in_batch"), softcap=softcap)
    out = CausalLMOutputWithPast(loss=loss, cache=cache, hidden_states=_hidden_states(hidden, normed))
    return return_as(out, return_dict, self.config)


def _hidden_states(hidden, normed):
    """Hugging Face's output_hidden_states: the embeddings and each layer's output, the last one normed."""
    return None if hidden is None else (*hidden, normed)
