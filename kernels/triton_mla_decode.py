"""mla_decode_attention in Triton: MLA's absorbed decode, one program per (sequence, block of
query heads), over the latent paged cache read in place.

The cache is the one layers/mla.py writes: [num_blocks, block_size, 1, D] with D = kv_lora_rank
+ qk_rope_head_dim (576 for DeepSeek-V3), one vector [c, k_r] per token that every query head
reads as its key, and whose first kv_lora_rank values (c) are also its value. The program walks
its sequence's keys in tiles of BLOCK_N positions; key position p is row p % block_size of block
table[p // block_size] (any block_size), as kernels/triton_paged_attention.py does. That kernel
holds a whole head_dim in one tile; here q.k runs over D in chunks of BLOCK_D columns, so a
576-wide vector never makes one [BLOCK_N, 1024] tile, and the value tile is the first
kv_lora_rank columns only ([BLOCK_N, next_pow2(kv_lora_rank)]).

Query heads share the one latent head, so a key tile is loaded once for BLOCK_H heads: the rows
of a [BLOCK_H >= 16, BLOCK_D] tile, the floor of tl.dot. Dots and the online softmax are float32
("ieee"), one rounding to q's dtype at the store. A sequence with no keys stores zeros. A
quantized cache (layers/kv_quant.py: int8 with a float32 scale per (block, offset), fp8 e4m3 with
one per layer, passed as a view of strides (0, 0, 1), e5m2 without) is read as stored and
converted to float32 in the tile; the scale multiplies a position's score and its value row
(HAS_SCALE).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atoll.kernels.backend import interpreting

INTERPRETED = interpreting()  # TRITON_INTERPRET at import: it decides what @triton.jit builds
LOG2E = 1.4426950408889634
BLOCK_N = 32  # key positions per tile
BLOCK_D = 64  # columns of D per q.k chunk
BLOCK_H = 16  # query heads per program: the floor of tl.dot's rows


@triton.jit
def _mla_decode_kernel(q_ptr, c_ptr, tables_ptr, ctx_ptr, out_ptr, s_ptr, qk_scale, HEADS, D, LATENT,
                       stride_qs, stride_qh, stride_cb, stride_cs, stride_sb, stride_ss, stride_ts, stride_os,
                       stride_oh, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, HAS_SCALE: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = head < HEADS
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    lat = tl.arange(0, BLOCK_L)
    lat_ok = lat < LATENT
    q_row = q_ptr + seq * stride_qs + head[:, None] * stride_qh  # [BLOCK_H, 1] pointers
    ctx = tl.load(ctx_ptr + seq).to(tl.int32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for start in range(0, ctx, BLOCK_N):
        pos = start + n
        ok = pos < ctx
        block = tl.load(tables_ptr + seq * stride_ts + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        row = (pos % BLOCK_SIZE).to(tl.int64)
        c_row = c_ptr + block[:, None] * stride_cb + row[:, None] * stride_cs  # [BLOCK_N, 1] pointers
        s = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
        for d0 in range(0, D, BLOCK_D):  # q.k over D, BLOCK_D columns at a time
            col = d0 + d
            col_ok = col < D
            q = tl.load(q_row + col[None, :], mask=h_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            k = tl.load(c_row + col[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            s += tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_H, BLOCK_N]
        v = tl.load(c_row + lat[None, :], mask=ok[:, None] & lat_ok[None, :], other=0.0).to(tl.float32)
        if HAS_SCALE:  # [BLOCK_N] scales of these positions: q.(x k) = x (q.k), and the value row x v
            x = tl.load(s_ptr + block * stride_sb + row * stride_ss, mask=ok, other=0.0)
            s = s * x[None, :]
            v = v * x[:, None]
        s = s * qk_scale  # log2 units
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)  # 0 on the first tile (m_i = -inf)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")  # [BLOCK_H, BLOCK_L]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no keys: acc is 0, so is the row
    tl.store(out_ptr + seq * stride_os + head[:, None] * stride_oh + lat[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & lat_ok[None, :])


def mla_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, *, latent: int, scale: float,
                         cache_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Inputs as the dispatcher checked them; the last axis of q, cache and block_tables
    contiguous (the dispatcher's job). -> [seqs, heads, latent] in q's dtype."""
    seqs, heads, dim = q.shape
    block_size = cache.shape[1]
    out = torch.empty(seqs, heads, latent, dtype=q.dtype, device=q.device)
    if seqs == 0:
        return out
    has_scale = cache_scale is not None
    _mla_decode_kernel[(seqs, triton.cdiv(heads, BLOCK_H))](
        q, cache, block_tables, context_lens, out, cache_scale if has_scale else out, scale * LOG2E,
        heads, dim, latent, q.stride(0), q.stride(1), cache.stride(0), cache.stride(1),
        *(cache_scale.stride()[:2] if has_scale else (0, 0)), block_tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D,
        BLOCK_L=max(16, triton.next_power_of_2(latent)), HAS_SCALE=has_scale, num_warps=4)
    return out
