"""fp8_grouped_gemm in Triton: the grouped GEMM of triton_grouped_gemm.py over fp8 operands
(DeepSeek-V3's recipe, as DeepGEMM's grouped GEMM computes it). One launch over every (row
block, column block) of the aligned layout; each row block belongs to one expert.

    a        float8 e4m3 [rows, K]: activations quantized per row and 128 columns
    a_scale  float32 [rows, ceil(K / 128)]
    w        float8 e4m3 [experts, N_w, K] (F.linear's [out, in] layout)
    w_scale  float32 [experts, N_w / SCALE_N, ceil(K / 128)]: SCALE_N = 1 is the layout the
             loader keeps (a checkpoint's 128 x 128 block scale repeated over the block's rows,
             layers/fp8_linear.py), SCALE_N = 128 the checkpoint's own weight_scale_inv grid

Each K tile lies inside one 128-column group (BLOCK_K divides 128), so a program multiplies
the fp8 tiles (tensor cores on GPUs with fp8), scales the float32 partial product by the row's
activation scale and the column's weight scale, and accumulates in float32. The epilogues are
the bf16 kernel's (SILU_MUL: [gate; up] rows, silu(g) * u; MUL_WEIGHT: the routing weight),
then one rounding to the output dtype. GATHER reads row sorted_ids[r] // top_k of a (and of
a_scale). Blocks at or past the used rows (a device scalar) return at once.

UPCAST is for Triton's interpreter only: its tl.dot cannot take fp8 tiles, so they are widened
to float32 first (fp8 -> float32 is exact, and so are the products of two fp8 values).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from atoll.kernels.alignment import MoeAlignment
from atoll.kernels.backend import interpreting
from atoll.kernels.configs import GemmConfig

INTERPRETED = interpreting()  # TRITON_INTERPRET at import: it decides what @triton.jit builds


@triton.jit
def _fp8_grouped_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr, rows_ptr,
    N, K, pairs, n_rows,
    stride_am, stride_ak, stride_asm, stride_ask, stride_we, stride_wn, stride_wk,
    stride_wse, stride_wsn, stride_wsk, stride_om, stride_on,
    TOP_K: tl.constexpr, GATHER: tl.constexpr, SILU_MUL: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    SCALE_N: tl.constexpr, GROUP_K: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
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
    as_ptrs = as_ptr + a_rows * stride_asm                                          # [BM]
    ws_ptrs = ws_ptr + expert * stride_wse + (offs_n // SCALE_N).to(tl.int64) * stride_wsn  # [BN]
    if SILU_MUL:
        ws_up_ptrs = ws_ptr + expert * stride_wse + ((offs_n + N) // SCALE_N).to(tl.int64) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SILU_MUL:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        group = k0 // GROUP_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        a_s = tl.load(as_ptrs + group * stride_ask, mask=row_ok, other=0.0)
        w_s = tl.load(ws_ptrs + group * stride_wsk, mask=n_ok, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        if SILU_MUL:
            up = tl.load(w_ptrs + N * stride_wn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            up_s = tl.load(ws_up_ptrs + group * stride_wsk, mask=n_ok, other=0.0)
            if UPCAST:
                up = up.to(tl.float32)
            acc_up += tl.dot(a, up) * a_s[:, None] * up_s[None, :]
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    if SILU_MUL:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_WEIGHT:
        rw = tl.load(weights_ptr + ids, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * rw[:, None]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok[None, :])


def fp8_grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     align: MoeAlignment, *, gather: bool, silu_mul: bool, weights: torch.Tensor | None,
                     out_dtype: torch.dtype, scale_n: int, group_k: int, config: GemmConfig) -> torch.Tensor:
    """[max_rows, N] in out_dtype; inputs checked by kernels.fp8_moe.fp8_grouped_gemm."""
    n = w.shape[1] // 2 if silu_mul else w.shape[1]
    k = w.shape[2]
    out = torch.empty(align.max_rows, n, dtype=out_dtype, device=a.device)
    if weights is not None:
        weights = weights.reshape(-1)
        if not weights.is_contiguous():
            weights = weights.contiguous()
    block_k = min(config.block_k, group_k)  # a K tile never straddles two scale groups
    num_m = align.max_rows // align.block_m
    grid = (num_m * triton.cdiv(n, config.block_n),)
    args = (a, a_scale, w, w_scale, out, weights if weights is not None else out, align.sorted_ids,
            align.block_expert, align.rows, n, k, align.pairs, align.max_rows,
            a.stride(0), a.stride(1), a_scale.stride(0), a_scale.stride(1),
            w.stride(0), w.stride(1), w.stride(2), w_scale.stride(0), w_scale.stride(1), w_scale.stride(2),
            out.stride(0), out.stride(1))
    meta = dict(TOP_K=align.top_k, GATHER=gather, SILU_MUL=silu_mul, MUL_WEIGHT=weights is not None,
                SCALE_N=scale_n, GROUP_K=group_k, UPCAST=INTERPRETED, BLOCK_M=align.block_m,
                BLOCK_N=config.block_n, BLOCK_K=block_k, GROUP_M=config.group_m, num_warps=config.num_warps)
    # the table is sized for Hopper's shared memory; on a GPU with less, drop pipeline stages
    for stages in range(config.num_stages, 0, -1):
        try:
            _fp8_grouped_gemm_kernel[grid](*args, **meta, num_stages=stages)
            return out
        except OutOfResources:
            if stages == 1:
                raise
    return out
