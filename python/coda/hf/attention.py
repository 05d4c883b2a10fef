"""Attention between coda's fused projections in a patched model: SDPA on the
(batch, seq, heads, head_dim) views the QKV GEMM writes, over a KV cache where there
is one, with the masks transformers itself builds for an SDPA model.

The masks come from transformers' own mask functions (create_causal_mask,
create_sliding_window_causal_mask), called as the unpatched model calls them, so
every case they handle is the same here: padding (a 2-D mask, left or right),
packed documents (position_ids restarting at 0 and no attention_mask, as
DataCollatorWithFlattening and TRL's packing make them: a block-diagonal causal
mask), sliding windows, a KV cache's offset, and a 4-D mask (or generate's dict of
them) passed as given. They return None where SDPA's is_causal is exact, which lets
SDPA pick its flash kernel, and decide that without reading the mask on the device
while compiling or capturing a CUDA graph.
"""

from __future__ import annotations

import copy
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def sdpa_config(config):
    """A copy of a model's config whose attention implementation is SDPA: coda attends
    with SDPA whatever the model was built with, and the mask functions build the mask
    of the implementation the config names (2-D for flash, BlockMask for flex)."""
    config = copy.copy(config)
    config._attn_implementation_internal = "sdpa"
    return config


class Masks:
    """The attention masks of one forward, one per kind of layer, made on first use.

    config: sdpa_config's; h: the input embeddings (batch, seq, d); attention_mask: as
    the model's forward takes it (None, 2-D (batch, past + seq) padding, 4-D, or a dict
    by layer type); cache: the KV cache or None; position_ids: (batch or 1, seq)."""

    def __init__(self, config, h: Tensor, attention_mask, cache, position_ids: Tensor, where: str):
        if attention_mask is not None and not isinstance(attention_mask, dict):
            if not torch.is_tensor(attention_mask) or attention_mask.dim() not in (2, 4):
                raise ValueError(f"{where}: attention_mask must be a 2-D (batch, seq) padding mask or a 4-D (batch, 1, "
                                 f"seq, kv_seq) mask, got {_describe(attention_mask)}")
        self.config, self.h, self.attention_mask = config, h, attention_mask
        self.cache, self.position_ids = cache, position_ids
        self._made: Dict[str, Optional[Tensor]] = {}

    def __call__(self, sliding_window: Optional[int]) -> Optional[Tensor]:
        kind = "full_attention" if sliding_window is None else "sliding_attention"
        if kind not in self._made:
            if isinstance(self.attention_mask, dict):
                self._made[kind] = self.attention_mask[kind]
            else:
                from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
                make = create_causal_mask if sliding_window is None else create_sliding_window_causal_mask
                self._made[kind] = make(config=self.config, inputs_embeds=self.h, attention_mask=self.attention_mask,
                                        cache=self.cache, position_ids=self.position_ids)
        return self._made[kind]


def _describe(x) -> str:
    return f"shape {tuple(x.shape)}" if torch.is_tensor(x) else type(x).__name__


def attend(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Optional[Tensor] = None, dropout_p: float = 0.0,
           cache=None, layer_idx: Optional[int] = None) -> Tensor:
    """Attention of q (B, S, H, hd) over k, v (B, S, Hkv, hd), H a multiple of Hkv
    (GQA), -> (B, S, H·hd), the layout the output projection reads. With a cache, k
    and v are appended to layer `layer_idx`'s and q attends over all of them. mask:
    Masks's (None: causal where q and the keys are as long, no mask for one query, as
    transformers' SDPA path reads it). q and k may be in coda's pair-permuted head
    layout: q·kᵀ does not see it, and a cache holds k in it, read back only here."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if cache is not None:
        k, v = cache.update(k, v, layer_idx)
    groups = q.shape[1] // k.shape[1]
    gqa = groups > 1
    if gqa and mask is not None:
        # with a mask SDPA's GQA falls back to its math kernel on CUDA (HF's use_gqa_in_sdpa): repeat instead
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        gqa = False
    if mask is not None and mask.dtype != torch.bool and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)  # an additive 4-D mask (eager's): SDPA adds it in q's dtype
    causal = mask is None and q.shape[2] > 1
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal,
                                         scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2).flatten(2)
