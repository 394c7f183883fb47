"""Triton kernels for the MoE and decode hot paths, each with a torch reference.

    from atoll.kernels import fused_moe, rms_norm, rotary_

The Triton path runs when every tensor is on CUDA and triton imports; the torch reference
(kernels/reference.py) runs otherwise. The config's kernels=torch forces the reference,
kernels=triton forces Triton (on CPU only under TRITON_INTERPRET=1; see
backend.interpreter()). Importing this package does not import triton.
"""

import importlib

__all__ = ["KernelError", "MoeAlignment", "fused_moe", "fused_moe_fp8", "grouped_gemm", "interpreter", "moe_align",
           "rms_norm", "rotary_", "unpermute_reduce", "use_triton"]

# name -> submodule; lazy (PEP 562) so building the CLI (`atoll bench kernels`) never imports torch
_WHERE = {"MoeAlignment": "alignment", "KernelError": "backend", "interpreter": "backend",
          "use_triton": "backend", "fused_moe": "moe", "fused_moe_fp8": "fp8_moe",
          "grouped_gemm": "ops", "moe_align": "ops",
          "rms_norm": "ops", "rotary_": "ops", "unpermute_reduce": "ops"}


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module 'atoll.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"atoll.kernels.{_WHERE[name]}"), name)
    globals()[name] = value  # bound once, as an eager import would
    return value
