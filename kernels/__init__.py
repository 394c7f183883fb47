"""Triton kernels for the MoE and decode hot paths, each with a torch reference.

    from atoll.kernels import fused_moe, rms_norm, rotary_

The Triton path runs when every tensor is on CUDA and triton imports; the torch reference
(kernels/reference.py) runs otherwise. ATOLL_KERNELS=torch forces the reference,
ATOLL_KERNELS=triton forces Triton (on CPU only under TRITON_INTERPRET=1; see
backend.interpreter()). Importing this package does not import triton.
"""

from atoll.kernels.alignment import MoeAlignment
from atoll.kernels.backend import KernelError, interpreter, use_triton
from atoll.kernels.moe import fused_moe
from atoll.kernels.ops import grouped_gemm, moe_align, rms_norm, rotary_, unpermute_reduce

__all__ = ["KernelError", "MoeAlignment", "fused_moe", "grouped_gemm", "interpreter", "moe_align",
           "rms_norm", "rotary_", "unpermute_reduce", "use_triton"]
