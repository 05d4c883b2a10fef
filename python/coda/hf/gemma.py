"""Gemma 3 causal LMs (Gemma3ForCausalLM, the text model) as coda ops.

Gemma's decoder layer differs from LLaMA's in four ways, each met here:

    q, k, v = RMSNormQKVRoPE(h)                 input_layernorm folded into the QKV GEMM, zero angles
    q, k    = RoPE(q_norm(q)), RoPE(k_norm(k))  per-head norms, then RoPE with the layer type's frequencies
    h       = h + post_attention_layernorm(o_proj(SDPA(q, k, v)))   norm and add: rmsnorm_residual
    h       = h + post_feedforward_layernorm(SwiGLUMLP(h))   pre_feedforward_layernorm folded, GeGLU-tanh

  * every RMSNorm scales by 1 + weight (zero_centered_gamma in coda.nn);
  * the sandwich norms (post_attention_layernorm, post_feedforward_layernorm) normalize a
    GEMM's output before the residual add: a norm over the whole row of the output, so
    they run after the GEMM, each with its residual add in one pass over the rows
    (ops.rmsnorm_residual, the modules' weights), and no statistics are chained from one
    GEMM to the next norm;
  * local (sliding-window) and global layers rotate with their own RoPE frequencies
    (config.rope_parameters per layer type);
  * the embedding is scaled by sqrt(hidden_size) (its own module does it) and the logits
    may be soft-capped (final_logit_softcapping, inside the loss).

Parameters are the model's own tensors except q/k/v and gate/up, fused once (as for
LLaMA); state_dict() has Hugging Face's keys and layouts.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .. import ops
from ..nn import RMSNormQKVRoPE, SwiGLUMLP, norm_eps
from . import llama
from .llama import DecoderLayer, QKNormRoPE, SelfAttention

_RENAMES = (("self_attn.qkv.norm.", "input_layernorm."), ("self_attn.qkv.q_proj.", "self_attn.q_proj."),
            ("self_attn.qkv.k_proj.", "self_attn.k_proj."), ("self_attn.qkv.v_proj.", "self_attn.v_proj."),
            ("mlp.norm.", "pre_feedforward_layernorm."), ("post_attn_norm.", "post_attention_layernorm."),
            ("post_ffn_norm.", "post_feedforward_layernorm."))


class GemmaDecoderLayer(DecoderLayer):
    """A Gemma 3 decoder layer as coda ops (see the module's docstring): ``self_attn``
    (SelfAttention with q_norm / k_norm), ``mlp`` (SwiGLUMLP, pre_feedforward_layernorm in
    front), and the sandwich norms ``post_attn_norm`` / ``post_feedforward_norm``
    (Hugging Face's modules). forward as DecoderLayer's; no statistics out (None)."""

    renames = _RENAMES

    def __init__(self, self_attn: SelfAttention, mlp: SwiGLUMLP, post_attn_norm: nn.Module, post_ffn_norm: nn.Module,
                 hf_keys):
        super().__init__(self_attn, mlp, hf_keys)
        self.post_attn_norm, self.post_ffn_norm = post_attn_norm, post_ffn_norm

    post_attention_layernorm = property(lambda self: self.post_attn_norm)
    pre_feedforward_layernorm = property(lambda self: self.mlp.norm)
    post_feedforward_layernorm = property(lambda self: self.post_ffn_norm)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, stats: Optional[torch.Tensor] = None,
                mask: Optional[torch.Tensor] = None, cache=None):
        attn = self.self_attn
        a = attn.attention(h, positions, None, mask, cache)
        h = self._post_norm(self.post_attn_norm, ops.linear(a, attn.o_proj.weight, attn.o_proj.bias), h)
        return self._post_norm(self.post_ffn_norm, self.mlp(h), h), None

    @staticmethod
    def _post_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + norm(x): Gemma's (1 + w) RMSNorm and the add in one pass (rmsnorm_residual)."""
        return ops.rmsnorm_residual(x, norm.weight, residual, norm_eps(norm), zero_centered=True)


def _inv_freq(config, layer_type: str, head_dim: int) -> torch.Tensor:
    """A layer type's RoPE frequencies, float64, from the config (not the rounded buffers)."""
    params = config.rope_parameters[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        half = head_dim // 2
        return float(params["rope_theta"]) ** (-torch.arange(half, dtype=torch.float64) / half)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", layer_type=layer_type)
    if float(scaling) != 1.0:
        raise NotImplementedError(f"coda.hf.patch: Gemma's {layer_type} RoPE ({rope_type}) scales cos/sin by {scaling}")
    return inv_freq.to(torch.float64)


def check(model) -> None:
    """Raise, naming the model and what it has, where a patch would not compute what it does."""
    name, config = type(model).__name__, model.config
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise NotImplementedError(f"coda.hf.patch: {name} soft-caps its attention logits "
                                  f"(attn_logit_softcapping={config.attn_logit_softcapping}), which SDPA cannot")
    if getattr(config, "use_bidirectional_attention", False):
        raise NotImplementedError(f"coda.hf.patch: {name} attends bidirectionally (use_bidirectional_attention): "
                                  f"coda's patch is for causal LMs")
    try:
        ops.check_activation(config.hidden_activation, "hf.patch", gated=True)
    except ValueError:
        raise NotImplementedError(f"coda.hf.patch: {name} has hidden_activation={config.hidden_activation!r}; coda's "
                                  f"gated MLP takes silu or gelu / gelu_tanh") from None
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        where = f"coda.hf.patch: {name}.model.layers[{i}]"
        if any(p.bias is not None for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            raise NotImplementedError(f"{where}: biased MLP projections are not supported")
        window = llama._window(attn, config)
        if window is not None and window != config.sliding_window:
            raise NotImplementedError(f"{where}: its sliding window {window} is not the config's "
                                      f"{config.sliding_window}, which transformers' mask takes")
        if attn.head_dim % 2:
            raise NotImplementedError(f"{where}: head_dim {attn.head_dim} is odd; RoPE rotates pairs")
    for layer_type in set(config.layer_types):
        _inv_freq(config, layer_type, model.model.layers[0].self_attn.head_dim)


@torch.no_grad()
def _decoder_layer(layer, config) -> GemmaDecoderLayer:
    attn, mlp = layer.self_attn, layer.mlp
    (wq, wk, wv), (bq, bk, bv), (heads, kv_heads) = llama._projections(attn, config)
    hd, w = attn.head_dim, wq
    zeros = torch.zeros(hd // 2, dtype=torch.float64)  # the GEMM rotates nothing: q_norm and k_norm come first
    qkv = RMSNormQKVRoPE(w.shape[1], heads, kv_heads, hd, 1.0, layer.input_layernorm.eps, bias=bq is not None,
                         inv_freq=zeros, zero_centered_gamma=True, device="meta", dtype=w.dtype)
    qkv.norm.weight = layer.input_layernorm.weight
    qkv.qkv_weight = nn.Parameter(qkv.permute(torch.cat([wq, wk, wv])), w.requires_grad)
    if bq is not None:
        qkv.qkv_bias = nn.Parameter(qkv.permute(torch.cat([bq, bk, bv])), bq.requires_grad)
    qkv.freq_bits = ops.rope_frequencies(hd, heads, kv_heads, inv_freq=zeros).view(torch.int32).to(w.device)
    rope = QKNormRoPE(_inv_freq(config, attn.layer_type, hd), zero_centered=True).to(w.device)
    self_attn = SelfAttention(qkv, attn.o_proj, float(attn.scaling), float(getattr(attn, "attention_dropout", 0.0)),
                              llama._window(attn, config), attn.layer_idx, attn.q_norm, attn.k_norm, rope)
    g = mlp.gate_proj.weight
    new_mlp = SwiGLUMLP(g.shape[1], g.shape[0], config.hidden_activation, normalization="RMSNorm",
                        eps=layer.pre_feedforward_layernorm.eps, zero_centered_gamma=True, device="meta",
                        dtype=g.dtype)
    new_mlp.norm.weight = layer.pre_feedforward_layernorm.weight
    new_mlp.gate_up_weight = nn.Parameter(ops.interleave_gate_up(g, mlp.up_proj.weight), g.requires_grad)
    new_mlp.down_proj = mlp.down_proj
    new = GemmaDecoderLayer(self_attn, new_mlp, layer.post_attention_layernorm, layer.post_feedforward_layernorm,
                            layer.state_dict(keep_vars=True).keys())
    new.train(layer.training)
    return new


def patch(model):
    """Patch a Gemma3ForCausalLM in place (see the module's docstring); returns it."""
    check(model)
    return llama.patch_layers(model, lambda layer: _decoder_layer(layer, model.config), zero_centered=True)


unpatch = llama.unpatch
