"""mla_jax: Multi-head Latent Attention decode for JAX on NVIDIA GPUs.

Paged, split-KV MLA decode kernels (CUDA and CPU) registered as XLA FFI
custom calls and exposed as jittable, shardable JAX ops.
"""

from . import _ffi
from ._context import merge_states_over_axis
from ._ffi import EXPORT_TARGETS
from .checks import check_inputs
from .fp8_cache import dequantize_latent_fp8, quantize_latent_fp8
from .kernels import CudaDevice, Explanation, KernelChoice, explain
from .paged_cache import append_kv, block_table_from_csr, merge_states
from .paged_decode import paged_decode
from .plan import DecodePlan, SparseDecodePlan
from .sparse_decode import sparse_decode

__version__ = "0.1.0"
__all__ = ["DecodePlan", "paged_decode", "check_inputs", "SparseDecodePlan", "sparse_decode",
           "quantize_latent_fp8", "dequantize_latent_fp8", "KernelChoice", "explain", "Explanation", "CudaDevice",
           "EXPORT_TARGETS", "append_kv", "block_table_from_csr", "merge_states", "merge_states_over_axis",
           "__version__"]

_ffi.register()
