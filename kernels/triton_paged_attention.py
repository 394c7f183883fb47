"""paged_decode_attention in Triton: one program per (sequence, kv head) of a decode step.

The cache is the one layers/attention.py writes: per layer k and v of [num_blocks, block_size,
kv_heads, head_dim], a block holding block_size consecutive positions of one sequence, and a
sequence's block table listing its blocks in order (padded with 0). The program walks its
sequence's keys in tiles of BLOCK_N positions; key position p is row p % block_size of block
table[p // block_size], read in place. The torch reference (and attend) instead gathers every
sequence's blocks into one copy with index_select, a full read and write of the context per
layer and step, which is what this kernel saves. Looking the block up per position, not per
tile, lets any block_size work, the contiguous cache's one block of max_len included.

The program serves the heads // kv_heads query heads sharing its kv head (GQA), so a key tile
is loaded once for the group: rows of a [BLOCK_G >= 16, head_dim] tile, the floor of tl.dot.
Dots and the online softmax are float32 ("ieee": exact float32, not tf32), with one rounding
to q's dtype at the store. head_dim need not be a power of two (the tile is padded and masked).
A sliding window starts the walk at its first key; a sequence with no keys stores zeros.
A quantized cache (layers/kv_quant.py: int8, fp8 e4m3/e5m2) is read as stored and converted
to float32 in the tile, times its per-(block, offset, kv head) scale when it has one (HAS_SCALE):
int8's plane, or fp8 e4m3's scale per kv head as a view of strides (0, 0, 1), every position
reading its head's one scale (a power of two: the tile holds exactly the values the torch
paths dequantize); e4m3's sink [kv_heads, head_dim] is added back to position 0's key and
value (HAS_SINK).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atoll.kernels.backend import interpreting

INTERPRETED = interpreting()  # TRITON_INTERPRET at import: it decides what @triton.jit builds
LOG2E = 1.4426950408889634
BLOCK_N = 32  # key positions per tile
NO_WINDOW = 2**30  # larger than any context


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, ctx_ptr, out_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr,
                         qk_scale, window,
                         GROUP, D, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                         stride_vh, stride_sb, stride_ss, stride_sh, stride_ts, stride_os, stride_oh,
                         BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                         BLOCK_D: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SINK: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    d_ok = d < D
    head = kvh * GROUP + g  # the query heads reading this kv head
    q_ok = (g < GROUP)[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + seq * stride_qs + head[:, None] * stride_qh + d[None, :], mask=q_ok, other=0.0)
    q = q.to(tl.float32)  # [BLOCK_G, BLOCK_D]
    ctx = tl.load(ctx_ptr + seq).to(tl.int32)
    lo = tl.maximum(ctx - window, 0)  # the first key the query sees
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if HAS_SINK:  # [BLOCK_D] fp8's sink of this kv head, added back at position 0
        k_sink = tl.load(kz_ptr + kvh * D + d, mask=d_ok, other=0.0)
        v_sink = tl.load(vz_ptr + kvh * D + d, mask=d_ok, other=0.0)
    for start in range(lo // BLOCK_N * BLOCK_N, ctx, BLOCK_N):  # every tile holds a key in [lo, ctx)
        pos = start + n
        ok = (pos >= lo) & (pos < ctx)
        block = tl.load(tables_ptr + seq * stride_ts + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        row = (pos % BLOCK_SIZE).to(tl.int64)
        kv_ok = ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + block[:, None] * stride_kb + row[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                    mask=kv_ok, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        if HAS_SCALE:  # [BLOCK_N] scales of these positions' kv head
            at = block * stride_sb + row * stride_ss + kvh * stride_sh
            k = k * tl.load(ks_ptr + at, mask=ok, other=0.0)[:, None]
        if HAS_SINK:
            k = k + tl.where((pos == 0)[:, None], k_sink[None, :], 0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_G, BLOCK_N], log2 units
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)  # 0 on the first tile (m_i = -inf)
        v = tl.load(v_ptr + block[:, None] * stride_vb + row[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                    mask=kv_ok, other=0.0).to(tl.float32)
        if HAS_SCALE:
            v = v * tl.load(vs_ptr + at, mask=ok, other=0.0)[:, None]
        if HAS_SINK:
            v = v + tl.where((pos == 0)[:, None], v_sink[None, :], 0.0)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no keys: acc is 0, so is the row
    tl.store(out_ptr + seq * stride_os + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_ok)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, *, scale: float,
                           sliding_window: int | None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, k_sink: torch.Tensor | None = None,
                           v_sink: torch.Tensor | None = None) -> torch.Tensor:
    """Inputs as the dispatcher checked them; the last axis of q, k_cache, v_cache and
    block_tables contiguous (the dispatcher's job)."""
    seqs, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if seqs == 0:
        return out
    group = heads // kv_heads
    has_scale = k_scale is not None
    if has_scale and k_scale.stride() != v_scale.stride():  # one layout: the strides are shared (e4m3's
        k_scale, v_scale = k_scale.contiguous(), v_scale.contiguous()  # head scales stay views, strides 0, 0, 1)
    has_sink = k_sink is not None
    if has_sink:
        k_sink, v_sink = k_sink.contiguous(), v_sink.contiguous()
    _paged_decode_kernel[(seqs, kv_heads)](
        q, k_cache, v_cache, block_tables, context_lens, out, k_scale if has_scale else out,
        v_scale if has_scale else out, k_sink if has_sink else out, v_sink if has_sink else out,
        scale * LOG2E, sliding_window or NO_WINDOW,
        group, dim, q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        *(k_scale.stride() if has_scale else (0, 0, 0)), block_tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(dim)), HAS_SCALE=has_scale, HAS_SINK=has_sink, num_warps=4)
    return out
