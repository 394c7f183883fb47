"""rms_norm in Triton: one program per row, the whole row in registers (hidden <= 32768).

With a residual, the sum x + residual is rounded to the residual stream's dtype (as the
model's own add would round it), written back into residual, and that rounded sum is what is
normalised. The normalised row is rounded to x's dtype before the weight multiplies it, as
layers/norm.py does (`weight * x.to(dtype)`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atoll.kernels.backend import interpreting
from atoll.kernels.configs import norm_warps

INTERPRETED = interpreting()  # TRITON_INTERPRET at import: it decides what @triton.jit builds


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, H, stride_x, stride_r, stride_o, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + row * stride_r + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
    normed = (xf * inv).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """x: [rows, H] with unit column stride (dispatcher's job); residual likewise."""
    rows, h = x.shape
    out = torch.empty(rows, h, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if rows == 0:
        return out
    block = triton.next_power_of_2(h)
    _rms_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, out, h, x.stride(0),
                              residual.stride(0) if residual is not None else 0, out.stride(0), eps,
                              HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=norm_warps(h))
    return out
