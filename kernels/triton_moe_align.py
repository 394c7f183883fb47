"""moe_align in Triton: three launches, no host sync, deterministic (pairs of one expert keep
their flat order, as in the reference).

  1. count    per chunk of ALIGN_BLOCK pairs, a histogram over local experts; also fills
              sorted_ids with the padding sentinel (grid-stride)
  2. offsets  one program: per-expert totals, padded starts (exclusive cumsum), and for every
              (chunk, expert) the row where that chunk's first pair of the expert goes
  3. scatter  per chunk: a pair's row is its chunk's offset for its expert plus the number of
              earlier pairs of the chunk with the same expert (a BLOCK x BLOCK compare);
              writes sorted_ids, position, and the block -> expert map (grid-stride)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atoll.kernels.backend import interpreting
from atoll.kernels.alignment import MoeAlignment, max_rows
from atoll.kernels.configs import ALIGN_BLOCK

INTERPRETED = interpreting()  # TRITON_INTERPRET at import: it decides what @triton.jit builds

FILL = 1024     # rows of sorted_ids one program fills per step
TILE_P = 16     # chunks the offsets kernel reads per step
B_STEP = 32     # blocks the scatter kernel maps to experts per step ([B_STEP, E_P2] compare)


@triton.jit
def _local_expert(ids_ptr, offs, pairs, experts, expert_offset):
    in_range = offs < pairs
    e = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int32) - expert_offset
    valid = in_range & (e >= 0) & (e < experts)
    return tl.where(valid, e, -1), valid


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, sorted_ptr, pairs, experts, expert_offset, n_rows,
                  BLOCK: tl.constexpr, E_P2: tl.constexpr, FILL: tl.constexpr):
    p = tl.program_id(0)
    offs = p * BLOCK + tl.arange(0, BLOCK)
    e, valid = _local_expert(ids_ptr, offs, pairs, experts, expert_offset)
    # non-local pairs go to bin `experts` (E_P2 > experts always), which is then zeroed;
    # tl.histogram's mask argument is newer than the triton versions atoll supports
    lanes = tl.arange(0, E_P2)
    hist = tl.histogram(tl.where(valid, e, experts), E_P2)  # [E_P2]
    tl.store(counts_ptr + p * E_P2 + lanes, tl.where(lanes < experts, hist, 0))
    # every row starts as padding; the scatter overwrites the rows that hold a pair
    step = tl.num_programs(0) * FILL
    for r0 in range(p * FILL, n_rows, step):
        r = r0 + tl.arange(0, FILL)
        tl.store(sorted_ptr + r, tl.full([FILL], 0, tl.int32) + pairs, mask=r < n_rows)


@triton.jit
def _offsets_kernel(counts_ptr, offsets_ptr, ends_ptr, rows_ptr, chunks,
                    BLOCK_M: tl.constexpr, E_P2: tl.constexpr, TILE_P: tl.constexpr):
    e = tl.arange(0, E_P2)
    total = tl.zeros([E_P2], dtype=tl.int32)
    for p0 in range(0, chunks, TILE_P):
        p = p0 + tl.arange(0, TILE_P)
        c = tl.load(counts_ptr + p[:, None] * E_P2 + e[None, :], mask=(p < chunks)[:, None], other=0)
        total += tl.sum(c, axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(ends_ptr + e, ends)
    tl.store(rows_ptr, tl.sum(padded, axis=0))
    run = ends - padded  # next free row of each expert
    for p0 in range(0, chunks, TILE_P):
        p = p0 + tl.arange(0, TILE_P)
        m = (p < chunks)[:, None]
        c = tl.load(counts_ptr + p[:, None] * E_P2 + e[None, :], mask=m, other=0)
        before = tl.cumsum(c, axis=0) - c  # pairs of earlier chunks in this tile
        tl.store(offsets_ptr + p[:, None] * E_P2 + e[None, :], run[None, :] + before, mask=m)
        run += tl.sum(c, axis=0)


@triton.jit
def _scatter_kernel(ids_ptr, offsets_ptr, ends_ptr, rows_ptr, sorted_ptr, position_ptr,
                    block_expert_ptr, pairs, experts, expert_offset, n_blocks,
                    BLOCK: tl.constexpr, E_P2: tl.constexpr, BLOCK_M: tl.constexpr, B_STEP: tl.constexpr):
    p = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    offs = p * BLOCK + i
    e, valid = _local_expert(ids_ptr, offs, pairs, experts, expert_offset)
    earlier = (e[:, None] == e[None, :]) & (i[None, :] < i[:, None])  # [BLOCK, BLOCK]
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    base = tl.load(offsets_ptr + p * E_P2 + e, mask=valid, other=0)
    pos = base + rank
    tl.store(sorted_ptr + pos, offs, mask=valid)
    tl.store(position_ptr + offs, tl.where(valid, pos, -1), mask=offs < pairs)
    # block b belongs to the expert count(ends <= b * BLOCK_M); blocks past the used rows: -1
    used = tl.load(rows_ptr)
    ends = tl.load(ends_ptr + tl.arange(0, E_P2))
    for b0 in range(p * B_STEP, n_blocks, tl.num_programs(0) * B_STEP):
        b = b0 + tl.arange(0, B_STEP)
        row = b * BLOCK_M
        owner = tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(row < used, owner, -1), mask=b < n_blocks)


def moe_align(topk_ids: torch.Tensor, experts: int, block_m: int, *, expert_offset: int = 0) -> MoeAlignment:
    tokens, top_k = topk_ids.shape
    pairs = tokens * top_k
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    dev = ids.device
    e_p2 = max(16, triton.next_power_of_2(experts + 1))  # + 1: the bin of non-local pairs
    chunks = max(1, triton.cdiv(pairs, ALIGN_BLOCK))
    n_rows = max_rows(pairs, experts, block_m)
    n_blocks = n_rows // block_m

    counts = torch.empty(chunks, e_p2, dtype=torch.int32, device=dev)
    offsets = torch.empty_like(counts)
    ends = torch.empty(e_p2, dtype=torch.int32, device=dev)
    rows = torch.empty(1, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(n_rows, dtype=torch.int32, device=dev)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    position = torch.empty(pairs, dtype=torch.int32, device=dev)

    _count_kernel[(chunks,)](ids, counts, sorted_ids, pairs, experts, expert_offset, n_rows,
                             BLOCK=ALIGN_BLOCK, E_P2=e_p2, FILL=FILL)
    _offsets_kernel[(1,)](counts, offsets, ends, rows, chunks, BLOCK_M=block_m, E_P2=e_p2, TILE_P=TILE_P)
    _scatter_kernel[(chunks,)](ids, offsets, ends, rows, sorted_ids, position, block_expert, pairs,
                               experts, expert_offset, n_blocks, BLOCK=ALIGN_BLOCK, E_P2=e_p2, BLOCK_M=block_m,
                               B_STEP=B_STEP)
    return MoeAlignment(sorted_ids, block_expert, rows, position, block_m, top_k, experts)
