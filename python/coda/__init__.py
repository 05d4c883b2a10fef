"""coda: Transformer-block GEMMs whose epilogues do the memory-bound work.

    import coda
    y = coda.ops.mlp(x, w1, b1, w2, b2, activation="gelu_tanh")
    layer = coda.nn.Linear(1024, 4096, activation="gelu_tanh")
"""

from . import nn, ops, reference
from ._fold_cache import clear as clear_fold_cache
from ._kernels import available as kernels_available
from ._kernels import device_ok as kernels_run_on

__version__ = "0.1.0"
__all__ = ["ops", "nn", "reference", "kernels_available", "kernels_run_on", "clear_fold_cache", "__version__"]
