"""Attention between coda's fused projections in a patched model: causal SDPA on the
(batch, seq, heads, head_dim) views the QKV GEMM writes, and the masks it needs.

Without padding and without a sliding window shorter than the sequence, SDPA runs
with is_causal=True and no mask, which lets it pick its flash kernel. A 2-D padding
mask (batch, seq) of ones and zeros, or a sliding window (Mistral, Qwen2), makes one
boolean (batch, 1, seq, seq) mask per forward, shared by the layers; it slows SDPA.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_mask(attention_mask: Optional[Tensor], batch: int, seq: int, device: torch.device,
                sliding_window: Optional[int] = None, where: str = "coda.hf") -> Optional[Tensor]:
    """None where plain causal attention is exact, else the boolean mask SDPA takes
    (True: attend). attention_mask: Hugging Face's 2-D (batch, seq) padding mask or
    None. Each token also attends to itself, so that a padding row (left padding)
    is never fully masked (whose softmax is NaN): its output is then finite, and
    unused, as its label should be ignore_index; no other row sees padded keys."""
    padded = attention_mask is not None
    if padded:
        if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, seq):
            raise NotImplementedError(
                f"{where}: attention_mask must be a 2-D (batch, seq) = {(batch, seq)} padding mask of ones and zeros, "
                f"got shape {tuple(attention_mask.shape)} (4-D or custom masks need the unpatched model: "
                f"coda.hf.unpatch)")
        # all ones is plain causal attention; asking costs a sync, which HF's SDPA path makes too. A compiled
        # graph keeps the mask instead of branching on data.
        if not torch.compiler.is_compiling() and bool(attention_mask.all()):
            padded = False
    windowed = sliding_window is not None and seq > sliding_window
    if not padded and not windowed:
        return None
    i = torch.arange(seq, device=device)
    keep = i[None, :] <= i[:, None]
    if windowed:
        keep = keep & (i[None, :] > i[:, None] - sliding_window)  # HF's sliding_window_overlay
    if padded:
        keep = keep & (attention_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
                       | torch.eye(seq, dtype=torch.bool, device=device))
    return keep.expand(batch, 1, seq, seq) if keep.dim() == 2 else keep


def attend(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Optional[Tensor] = None,
           dropout_p: float = 0.0) -> Tensor:
    """Causal attention of q (B, S, H, hd) over k, v (B, S, Hkv, hd), H a multiple of
    Hkv (GQA) -> (B, S, H·hd), the layout the output projection reads. q and k may be
    in coda's pair-permuted head layout: q·kᵀ does not see it."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    groups = q.shape[1] // k.shape[1]
    gqa = groups > 1
    if gqa and mask is not None:
        # with a mask SDPA's GQA falls back to its math kernel on CUDA (HF's use_gqa_in_sdpa): repeat instead
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        gqa = False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=mask is None,
                                         scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2).flatten(2)
