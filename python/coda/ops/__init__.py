"""coda's fused ops: one public function per fused op, each one C++ op per
direction on the kernel path (torch.ops.coda.*, fakes and autograd here, so
torch.compile(fullgraph=True) traces them), and a reference path of plain
torch code for what has no kernel. Activations (..., features), weights in
nn.Linear's (out, in) layout."""

from ._checks import check_activation
from ._checks import layernorm as check_normalization
from .dropout import dropout_residual, dropout_residual_reference
from .glu import (concatenated_to_interleaved, glu_mlp, glu_mlp_reference, interleave_gate_up,
                  interleaved_to_concatenated, norm_glu_mlp, norm_glu_mlp_reference, split_gate_up)
from .linear import linear, linear_reference, mlp, mlp_reference
from .loss import linear_cross_entropy, linear_cross_entropy_reference
from .norm import (FoldedWeight, fold_norm_weight, layernorm_linear, linear_residual, norm_linear_reference,
                   norm_mlp, norm_mlp_reference, normalize_reference, rmsnorm_linear, rmsnorm_residual,
                   rmsnorm_residual_reference, row_stats)
from .rope import (head_norm_rope, head_norm_rope_reference, rmsnorm_linear_rope, rmsnorm_linear_rope_reference,
                   rope_frequencies, rope_permute_qk, rope_unpermute_qk)

__all__ = ["linear", "mlp", "layernorm_linear", "rmsnorm_linear", "norm_mlp", "linear_residual", "row_stats",
           "fold_norm_weight", "FoldedWeight", "linear_reference", "mlp_reference", "norm_linear_reference",
           "norm_mlp_reference", "normalize_reference", "glu_mlp", "norm_glu_mlp", "glu_mlp_reference",
           "norm_glu_mlp_reference", "interleave_gate_up", "split_gate_up", "concatenated_to_interleaved",
           "interleaved_to_concatenated", "rmsnorm_linear_rope", "rmsnorm_linear_rope_reference", "rope_frequencies",
           "rope_permute_qk", "rope_unpermute_qk", "head_norm_rope", "head_norm_rope_reference", "linear_cross_entropy", "linear_cross_entropy_reference",
           "check_activation", "check_normalization", "rmsnorm_residual", "rmsnorm_residual_reference",
           "dropout_residual", "dropout_residual_reference"]
