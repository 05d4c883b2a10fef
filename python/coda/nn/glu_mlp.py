from __future__ import annotations

import math
from typing import Iterable, Optional, Tuple

import torch
from torch import nn

from .. import ops
from ._parts import part_property
from .norm_linear import make_norm, norm_eps, norm_gamma


def replace_key(state_dict, prefix: str, key: str, items: Iterable[Tuple[str, torch.Tensor]]) -> None:
    """In a state_dict post hook: put `items` (name, tensor) where prefix + key
    stood. When the hook runs, the module's own keys are the last ones in the
    dict, so the keys after it are moved after the new ones: the order stays
    the module's."""
    if prefix + key not in state_dict:
        return
    keys = list(state_dict)
    tail = [(k, state_dict.pop(k)) for k in keys[keys.index(prefix + key):]]
    state_dict.update((prefix + name, t) for name, t in items)
    state_dict.update(tail[1:])


def exported(t: torch.Tensor, parts: Iterable[torch.Tensor]):
    """The tensors a state_dict gets for `parts`, views or copies of its entry t:
    with keep_vars (t is the Parameter), the views, which carry gradients;
    else contiguous copies of their own, as safetensors wants them."""
    return list(parts) if isinstance(t, nn.Parameter) else [p.detach().clone(memory_format=torch.contiguous_format)
                                                            for p in parts]


class SwiGLUMLP(nn.Module):
    """LLaMA's MLP, down(act(gate(x)) ⊙ up(x)) (+ residual): SwiGLU with
    activation="silu", GeGLU with "gelu_tanh" (Gemma) or "gelu".

    Parameters: ``gate_up_weight`` (2F, D), gate and up rows interleaved
    (row 2j = gate[j], 2j + 1 = up[j]) as the kernel reads them, and
    ``down_proj`` (nn.Linear, no bias). ``normalization="RMSNorm"`` (or
    "LayerNorm") adds ``norm`` in front, LLaMA's post-attention norm, for
    coda.ops.norm_glu_mlp to fold into the gate/up GEMM.

    state_dict() has the keys of Hugging Face's LlamaMLP / MistralMLP /
    Qwen2MLP, in their layout: ``gate_proj.weight``, ``up_proj.weight`` (copies
    of the interleaved rows; views with keep_vars=True), ``down_proj.weight``
    (and ``norm.weight`` with a norm). load_state_dict takes those, or
    ``gate_up_weight`` already interleaved. zero_centered_gamma (Transformer Engine's
    name): the norm scales by 1 + norm.weight (Gemma's), the weight initialized to 0.

    forward(x, residual=None, stats=None, return_stats=False): residual=x is
    the pre-norm block x + MLP(Norm(x)); stats, return_stats (with a norm
    only) as norm_glu_mlp takes them; returns y, or (y, stats of y).
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation: str = "silu", bias: bool = False,
                 normalization: Optional[str] = None, eps: Optional[float] = None, zero_centered_gamma: bool = False,
                 device=None, dtype=None):
        super().__init__()
        self.zero_centered_gamma = bool(zero_centered_gamma)
        ops.check_activation(activation, "nn.SwiGLUMLP", gated=True)
        if bias:
            raise NotImplementedError("coda.nn.SwiGLUMLP: biased gate/up/down projections are not supported yet")
        self.activation = activation
        self.normalization = normalization
        if normalization is not None:
            self.norm = make_norm(normalization, hidden_size, eps, device, dtype)
        self.gate_up_weight = nn.Parameter(torch.empty(2 * ffn_hidden_size, hidden_size, device=device, dtype=dtype))
        self.down_proj = nn.Linear(ffn_hidden_size, hidden_size, bias=False, device=device, dtype=dtype)
        self.reset_parameters()
        self.register_state_dict_post_hook(_save_gate_up)
        self.register_load_state_dict_pre_hook(_load_gate_up)

    # the state_dict's gate_proj / up_proj as attributes (coda/nn/_parts.py)
    gate_proj, up_proj = (part_property(p, i, lambda m, kind: ops.split_gate_up(m.gate_up_weight.detach())
                                        if kind == "weight" else None) for i, p in enumerate(("gate_proj", "up_proj")))

    def reset_parameters(self) -> None:
        """gate_up_weight as nn.Linear initializes gate_proj and up_proj (the
        rows are independent, so interleaving changes nothing)."""
        nn.init.kaiming_uniform_(self.gate_up_weight, a=math.sqrt(5))
        norm = getattr(self, "norm", None)
        if self.zero_centered_gamma and norm is not None and not norm.weight.is_meta:
            nn.init.zeros_(norm.weight)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, stats: Optional[torch.Tensor] = None,
                return_stats: bool = False):
        if self.normalization is None:
            if stats is not None or return_stats:
                raise ValueError("coda.nn.SwiGLUMLP: stats and return_stats need a norm in front "
                                 "(normalization='RMSNorm')")
            return ops.glu_mlp(x, self.gate_up_weight, self.down_proj.weight, self.activation, residual)
        layernorm = isinstance(self.norm, nn.LayerNorm)
        gamma = norm_gamma(self.norm.weight, self.zero_centered_gamma)
        return ops.norm_glu_mlp(x, gamma, self.norm.bias if layernorm else None, self.gate_up_weight,
                                self.down_proj.weight, "LayerNorm" if layernorm else "RMSNorm", norm_eps(self.norm),
                                self.activation, residual, stats, return_stats)

    def extra_repr(self) -> str:
        f2, d = self.gate_up_weight.shape
        return (f"gate_up_weight=({f2}, {d}), activation={self.activation!r}, normalization={self.normalization!r}, "
                f"zero_centered_gamma={self.zero_centered_gamma}")


def _save_gate_up(module, state_dict, prefix, local_metadata) -> None:
    key = prefix + "gate_up_weight"
    if key in state_dict:
        w = state_dict[key]
        replace_key(state_dict, prefix, "gate_up_weight",
                    zip(("gate_proj.weight", "up_proj.weight"), exported(w, ops.split_gate_up(w))))


def _load_gate_up(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                  error_msgs) -> None:
    gate, up = prefix + "gate_proj.weight", prefix + "up_proj.weight"
    if gate not in state_dict or up not in state_dict:
        return  # gate_up_weight itself, or a partial dict: load_state_dict reports what is missing
    if state_dict[gate].shape != state_dict[up].shape:
        error_msgs.append(f"{gate} {tuple(state_dict[gate].shape)} and {up} {tuple(state_dict[up].shape)} must have "
                          f"the same shape (F, D)")
        return
    state_dict[prefix + "gate_up_weight"] = ops.interleave_gate_up(state_dict.pop(gate), state_dict.pop(up))
