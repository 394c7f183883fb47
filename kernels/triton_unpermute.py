"""unpermute_reduce in Triton: one program per (token, column block) gathers the token's top-k
rows from the aligned layout (through `position`) and sums them in float32. It is the
scatter-add of the expert outputs back to token order, written as a gather so that there are
no atomics and the sum order (slot 0, 1, ...) is fixed: the result is deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atoll.kernels.backend import interpreting
from atoll.kernels.alignment import MoeAlignment
from atoll.kernels.configs import UNPERMUTE_BLOCK_N

INTERPRETED = interpreting()  # TRITON_INTERPRET at import: it decides what @triton.jit builds


@triton.jit
def _unpermute_kernel(y_ptr, position_ptr, weights_ptr, out_ptr, N, stride_y, stride_o,
                      TOP_K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pos = tl.load(position_ptr + t * TOP_K + j)
        local = (cols * 0 + pos) >= 0  # [BLOCK_N]; slots of another rank's expert add nothing
        row = tl.load(y_ptr + pos.to(tl.int64) * stride_y + cols, mask=col_ok & local, other=0.0)
        row = row.to(tl.float32)
        if HAS_WEIGHTS:
            row = row * tl.load(weights_ptr + t * TOP_K + j).to(tl.float32)
        acc += row
    tl.store(out_ptr + t.to(tl.int64) * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def unpermute_reduce(y: torch.Tensor, align: MoeAlignment, *, weights: torch.Tensor | None = None) -> torch.Tensor:
    n = y.shape[1]
    out = torch.empty(align.tokens, n, dtype=y.dtype, device=y.device)
    if align.tokens == 0:
        return out
    if weights is not None and not weights.is_contiguous():
        weights = weights.contiguous()
    block_n = min(UNPERMUTE_BLOCK_N, triton.next_power_of_2(n))
    grid = (align.tokens, triton.cdiv(n, block_n))
    _unpermute_kernel[grid](y, align.position, weights if weights is not None else y, out, n,
                            y.stride(0), out.stride(0), TOP_K=align.top_k,
                            HAS_WEIGHTS=weights is not None, BLOCK_N=block_n, num_warps=4)
    return out
