"""grouped_gemm in Triton: one launch over every (row block, column block) of the aligned
layout; each row block belongs to one expert (moe_align made it so), so a program multiplies
BLOCK_M rows by one expert's [BLOCK_N, K] weight slice.

Epilogues, in float32 before the one rounding to the output dtype:
  SILU_MUL    w holds [gate; up] (2N rows); both are accumulated and the tile is silu(g) * u,
              so the [rows, 2N] gate/up activation never reaches memory
  MUL_WEIGHT  the row's routing weight, weights.flat[sorted_ids[row]]
UPCAST is for Triton's interpreter only, whose tl.dot multiplies bf16/fp16 tiles as their raw
bits: there the tiles are widened to float32 first, which gives the products a bf16 tensor-core
dot gives (bf16 x bf16 is exact in float32), so interpreter runs check the same math.

GATHER reads the input row of token sorted_ids[row] // top_k straight from x, so the permuted
copy of x is never made either. Blocks at or past the used rows (a device scalar) return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from atoll.kernels.backend import interpreting
from atoll.kernels.alignment import MoeAlignment
from atoll.kernels.configs import GemmConfig, dot_precision

INTERPRETED = interpreting()  # TRITON_INTERPRET at import: it decides what @triton.jit builds


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr, rows_ptr,
    N, K, pairs, n_rows,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    TOP_K: tl.constexpr, GATHER: tl.constexpr, SILU_MUL: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # swizzle: GROUP_M row blocks walk the N blocks together so weight tiles stay in L2
    pid = tl.program_id(0)
    num_m = n_rows // BLOCK_M
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size

    if pid_m * BLOCK_M >= tl.load(rows_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ptr + offs_m)  # [BLOCK_M] flat pair index, `pairs` for padding
    row_ok = ids < pairs
    if GATHER:
        a_rows = (ids // TOP_K).to(tl.int64)
    else:
        a_rows = offs_m.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak      # [BM, BK]
    w_ptrs = (w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
              + offs_k[:, None] * stride_wk)                                       # [BK, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SILU_MUL:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if SILU_MUL:
            up = tl.load(w_ptrs + N * stride_wn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST:
                up = up.to(tl.float32)
            acc_up = tl.dot(a, up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    if SILU_MUL:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_WEIGHT:
        rw = tl.load(weights_ptr + ids, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * rw[:, None]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok[None, :])


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, align: MoeAlignment, *, gather: bool = False,
                 silu_mul: bool = False, weights: torch.Tensor | None = None,
                 config: GemmConfig) -> torch.Tensor:
    n = w.shape[1] // 2 if silu_mul else w.shape[1]
    k = w.shape[2]
    out = torch.empty(align.max_rows, n, dtype=a.dtype, device=a.device)
    if weights is not None:
        weights = weights.reshape(-1)
        if not weights.is_contiguous():
            weights = weights.contiguous()
    num_m = align.max_rows // align.block_m
    grid = (num_m * triton.cdiv(n, config.block_n),)
    args = (a, w, out, weights if weights is not None else out, align.sorted_ids, align.block_expert,
            align.rows, n, k, align.pairs, align.max_rows,
            a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1))
    meta = dict(TOP_K=align.top_k, GATHER=gather, SILU_MUL=silu_mul, MUL_WEIGHT=weights is not None,
                UPCAST=INTERPRETED and a.dtype != torch.float32,
                PRECISION="ieee" if INTERPRETED else dot_precision(a.dtype), BLOCK_M=align.block_m,
                BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
                num_warps=config.num_warps)
    # the table is sized for Hopper's shared memory; on a GPU with less, drop pipeline stages
    for stages in range(config.num_stages, 0, -1):
        try:
            _grouped_gemm_kernel[grid](*args, **meta, num_stages=stages)
            return out
        except OutOfResources:
            if stages == 1:
                raise
    return out
