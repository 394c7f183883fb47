"""rotary in Triton, in place on q, then on k: program (t, b) rotates a block of
ROTARY_BLOCK_H heads of token t. The rotate_half convention:

    out[:half] = x[:half] * cos[:half] - x[half:] * sin[:half]
    out[half:] = x[half:] * cos[half:] + x[:half] * sin[half:]

which is q*cos + rotate_half(q)*sin for any cos/sin (cat(freqs, freqs) makes both halves of
cos equal, but the kernel does not rely on it). Math in float32, one rounding per element.
q and k may be strided views (a slice of a fused qkv output, or the rope part of a head);
only the head_dim axis must be contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atoll.kernels.backend import interpreting
from atoll.kernels.configs import ROTARY_BLOCK_H

INTERPRETED = interpreting()  # TRITON_INTERPRET at import: it decides what @triton.jit builds


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, heads, HALF, stride_xt, stride_xh, stride_ct, stride_st,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HALF
    c1 = tl.load(cos_ptr + t * stride_ct + d, mask=d_ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_st + d, mask=d_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_st + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    ok = (h < heads)[:, None] & d_ok[None, :]
    p1 = x_ptr + t * stride_xt + h[:, None].to(tl.int64) * stride_xh + d[None, :]  # [BLOCK_H, BLOCK_D]
    x1 = tl.load(p1, mask=ok, other=0.0)
    x2 = tl.load(p1 + HALF, mask=ok, other=0.0)
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    tl.store(p1, (f1 * c1[None, :] - f2 * s1[None, :]).to(x1.dtype), mask=ok)
    tl.store(p1 + HALF, (f2 * c2[None, :] + f1 * s2[None, :]).to(x1.dtype), mask=ok)


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    tokens, _, dim = q.shape
    if tokens == 0:
        return
    half = dim // 2
    for x in (q, k):  # two launches: a branch between q and k would not compile when a head count is 1
        grid = (tokens, triton.cdiv(x.shape[1], ROTARY_BLOCK_H))
        _rotary_kernel[grid](x, cos, sin, x.shape[1], half, x.stride(0), x.stride(1), cos.stride(0),
                             sin.stride(0), BLOCK_H=ROTARY_BLOCK_H, BLOCK_D=triton.next_power_of_2(half),
                             num_warps=4)
