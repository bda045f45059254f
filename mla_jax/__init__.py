"""mla_jax: Multi-head Latent Attention decode for JAX on NVIDIA GPUs.

Paged, split-KV MLA decode kernels (CUDA and CPU) registered as XLA FFI
custom calls and exposed as jittable, shardable JAX ops.
"""

from . import _ffi
from .checks import check_inputs
from .paged_decode import paged_decode
from .plan import DecodePlan

__version__ = "0.1.0"
__all__ = ["DecodePlan", "paged_decode", "check_inputs", "__version__"]

_ffi.register()
