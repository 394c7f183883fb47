"""Block-fp8 GEMM in Triton (DeepSeek-V3's recipe): out[M, N] = (a * a_scale) @ (b * b_scale).T
with a [M, K] float8 e4m3 activations quantized per token per GROUP_K columns (a_scale
[M, K / GROUP_K]) and b [N, K] float8 e4m3 weights with one scale per row and GROUP_K columns
(b_scale [N, K / GROUP_K]: a 128 x 128 checkpoint block's scale repeated over its rows, which
also serves a tensor-parallel shard or a merged [gate; up] weight whose rows start inside a
block). Each K tile lies inside one group, so a program multiplies the fp8 tiles (tensor
cores on GPUs with fp8), scales the float32 partial product by its row and column scales and
accumulates in float32; the one rounding is to the output dtype.

UPCAST is for Triton's interpreter only: its tl.dot cannot take fp8 tiles, so they are widened
to float32 first (fp8 -> float32 is exact, and so are the products of two fp8 values), which
gives the same math the tensor cores do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atoll.kernels.backend import interpreting

INTERPRETED = interpreting()  # TRITON_INTERPRET at import: it decides what @triton.jit builds


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, b_ptr, out_ptr, as_ptr, bs_ptr, M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_om, stride_on, stride_asm, stride_ask, stride_bsn, stride_bsk,
    GROUP_K: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k = k0 * BLOCK_K + offs_k
        k_ok = k < K
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        b = tl.load(b_ptr + offs_n[None, :] * stride_bn + k[:, None] * stride_bk,
                    mask=n_ok[None, :] & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
        group = (k0 * BLOCK_K) // GROUP_K
        a_s = tl.load(as_ptr + offs_m * stride_asm + group * stride_ask, mask=m_ok, other=0.0)
        b_s = tl.load(bs_ptr + offs_n * stride_bsn + group * stride_bsk, mask=n_ok, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, out,
             mask=m_ok[:, None] & n_ok[None, :])


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, *,
             out_dtype: torch.dtype, group_k: int = 128) -> torch.Tensor:
    """[M, N] in out_dtype; inputs checked by kernels.ops.fp8_linear."""
    M, K = a.shape
    N = b.shape[0]
    out = torch.empty(M, N, dtype=out_dtype, device=a.device)
    block_m = 16 if M <= 16 else (32 if M <= 32 else 64)
    block_n, block_k = 64, min(group_k, 128)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _fp8_gemm_kernel[grid](
        a, b, out, a_scale, b_scale, M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1),
        GROUP_K=group_k, UPCAST=INTERPRETED, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out
