from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .. import ops
from ..ops import glu
from .norm_linear import make_norm


class SwiGLUMLP(nn.Module):
    """LLaMA's MLP, down(act(gate(x)) ⊙ up(x)) (+ residual): SwiGLU with
    activation="silu", GeGLU with "gelu_tanh" (Gemma) or "gelu".

    Parameters live in ``gate_proj``, ``up_proj`` and ``down_proj`` (nn.Linear, no
    bias by default), the keys of Hugging Face's LlamaMLP / MistralMLP / Qwen2MLP,
    so their state_dicts load as they are. ``normalization="RMSNorm"`` (or
    "LayerNorm") adds ``norm`` in front, LLaMA's post-attention norm, for
    coda.ops.norm_glu_mlp to fold into the gate/up GEMM.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation: str = "silu", bias: bool = False,
                 normalization: Optional[str] = None, eps: Optional[float] = None, device=None, dtype=None):
        super().__init__()
        glu._gate_code(activation, "nn.SwiGLUMLP")
        if bias:
            raise NotImplementedError("coda.nn.SwiGLUMLP: biased gate/up/down projections are not supported yet")
        self.activation = activation
        self.normalization = normalization
        if normalization is not None:
            self.norm = make_norm(normalization, hidden_size, eps, device, dtype)
        kw = dict(bias=False, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(hidden_size, ffn_hidden_size, **kw)
        self.up_proj = nn.Linear(hidden_size, ffn_hidden_size, **kw)
        self.down_proj = nn.Linear(ffn_hidden_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None,
                stats: Optional[torch.Tensor] = None) -> torch.Tensor:
        w = (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        if self.normalization is None:
            return ops.glu_mlp(x, *w, self.activation, residual)
        layernorm = isinstance(self.norm, nn.LayerNorm)
        return ops.norm_glu_mlp(x, self.norm.weight, self.norm.bias if layernorm else None, *w,
                                "LayerNorm" if layernorm else "RMSNorm", self.norm.eps, self.activation, residual,
                                stats)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, normalization={self.normalization!r}"
