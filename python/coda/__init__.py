"""coda: Transformer-block GEMMs whose epilogues do the memory-bound work.

    import coda
    y = coda.ops.mlp(x, w1, b1, w2, b2, activation="gelu_tanh")
    layer = coda.nn.LayerNormLinear(1024, 3072)
"""

from . import hf, nn, ops
from ._kernels import FallbackWarning, set_strict
from ._kernels import available as kernels_available
from ._kernels import device_ok as kernels_run_on
from .hf import patch, unpatch

__version__ = "0.1.0"
__all__ = ["ops", "nn", "hf", "patch", "unpatch", "kernels_available", "kernels_run_on", "set_strict",
           "FallbackWarning", "__version__"]
