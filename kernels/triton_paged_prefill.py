"""paged_prefill_attention in Triton: the new tokens of a prefill step (chunks of several
sequences, each possibly over a cached prefix) attend over the paged cache in place.

q holds every sequence's new tokens back to back; sequence i owns rows query_starts[i] ..
query_starts[i + 1] of q, at positions starts[i], starts[i] + 1, ... Their keys and values are
already in the cache (attend writes them before it attends). A program serves one tile of
BLOCK_M consecutive query tokens of one sequence and one kv head, with all the query heads that
share it (GQA): its rows are (token, head) pairs, token-major, BLOCK_M * BLOCK_G of them, so a
key tile is loaded once for the group. The grid is (sequences, tiles of the longest chunk, kv
heads); the tiles past a shorter chunk's end have nothing to do and store nothing.

The walk over keys is as the decode kernel's (triton_paged_attention.py): tiles of BLOCK_N
positions, key position p read at row p % block_size of block table[p // block_size], from the
first key any row of the tile sees (the window's start for its first token) to the last token's
own position. Each row masks its own keys: causal (key <= its position) and, with a window,
key > position - window, as attend's mask. Dots and the online softmax are float32 ("ieee"),
one rounding to q's dtype at the store. A row whose keys in a tile are all masked keeps its
running max at -inf; the max used for the exponentials is then 0, so that tile adds nothing.
A quantized cache (int8, fp8 e4m3/e5m2) is read as stored, converted to float32 and times its
per-(block, offset, kv head) scale when it has one (HAS_SCALE; e4m3's per-head scale as a view
of strides 0, 0, 1, as in the decode kernel), and e4m3's sink added back at position 0 (HAS_SINK). The step's own new tokens are read from the cache
too: every prefill attends to the stored values (layers/attention.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atoll.kernels.backend import interpreting

INTERPRETED = interpreting()  # TRITON_INTERPRET at import: it decides what @triton.jit builds
LOG2E = 1.4426950408889634
BLOCK_N = 32  # key positions per tile
ROWS = 64  # (token, head) rows per program: BLOCK_M tokens times BLOCK_G heads
NO_WINDOW = 2**30  # larger than any context


@triton.jit
def _paged_prefill_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, qstarts_ptr, starts_ptr, out_ptr, ks_ptr, vs_ptr,
                          kz_ptr, vz_ptr, qk_scale, window, GROUP, D, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                          stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh, stride_ts,
                          stride_ot, stride_oh, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                          HAS_SCALE: tl.constexpr, HAS_SINK: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    kvh = tl.program_id(2).to(tl.int64)
    r = tl.arange(0, BLOCK_M * BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    d_ok = d < D
    q_lo = tl.load(qstarts_ptr + seq).to(tl.int32)
    count = tl.load(qstarts_ptr + seq + 1).to(tl.int32) - q_lo  # this sequence's new tokens
    start = tl.load(starts_ptr + seq).to(tl.int32)  # positions cached before the step
    t0 = tile * BLOCK_M
    tok = t0 + r // BLOCK_G  # the row's token within the chunk
    g = r % BLOCK_G
    head = kvh * GROUP + g
    row_ok = (tok < count) & (g < GROUP)
    pos = start + tok  # the row's position
    at_q = (q_lo + tok).to(tl.int64)
    q_ok = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + at_q[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=q_ok, other=0.0)
    q = q.to(tl.float32)  # [ROWS, BLOCK_D]
    hi = tl.where(t0 < count, start + tl.minimum(t0 + BLOCK_M, count), 0)  # past the tile's last position
    lo = tl.maximum(start + t0 - window + 1, 0)  # the first key the tile's first token sees
    m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
    if HAS_SINK:  # [BLOCK_D] fp8's sink of this kv head, added back at position 0
        k_sink = tl.load(kz_ptr + kvh * D + d, mask=d_ok, other=0.0)
        v_sink = tl.load(vz_ptr + kvh * D + d, mask=d_ok, other=0.0)
    for k0 in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
        key = k0 + n
        ok = (key >= lo) & (key < hi)
        block = tl.load(tables_ptr + seq * stride_ts + key // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        row = (key % BLOCK_SIZE).to(tl.int64)
        kv_ok = ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + block[:, None] * stride_kb + row[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                    mask=kv_ok, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        if HAS_SCALE:
            at = block * stride_sb + row * stride_ss + kvh * stride_sh
            k = k * tl.load(ks_ptr + at, mask=ok, other=0.0)[:, None]
        if HAS_SINK:
            k = k + tl.where((key == 0)[:, None], k_sink[None, :], 0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [ROWS, BLOCK_N], log2 units
        sees = ok[None, :] & (key[None, :] <= pos[:, None]) & (key[None, :] > pos[:, None] - window)
        s = tl.where(sees, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: exp2 gives 0, not NaN
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        v = tl.load(v_ptr + block[:, None] * stride_vb + row[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                    mask=kv_ok, other=0.0).to(tl.float32)
        if HAS_SCALE:
            v = v * tl.load(vs_ptr + at, mask=ok, other=0.0)[:, None]
        if HAS_SINK:
            v = v + tl.where((key == 0)[:, None], v_sink[None, :], 0.0)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + at_q[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_ok)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_starts: torch.Tensor, starts: torch.Tensor, *,
                            max_query_len: int, scale: float, sliding_window: int | None,
                            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                            k_sink: torch.Tensor | None = None, v_sink: torch.Tensor | None = None) -> torch.Tensor:
    """Inputs as the dispatcher checked them; the last axis of q, k_cache, v_cache and
    block_tables contiguous, query_starts and starts contiguous (the dispatcher's job)."""
    tokens, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    seqs = starts.shape[0]
    if tokens == 0 or seqs == 0 or max_query_len == 0:
        return out
    group = heads // kv_heads
    block_g = triton.next_power_of_2(group)
    block_m = max(1, ROWS // block_g)
    has_scale = k_scale is not None
    if has_scale and k_scale.stride() != v_scale.stride():  # one layout: the strides are shared (e4m3's
        k_scale, v_scale = k_scale.contiguous(), v_scale.contiguous()  # head scales stay views, strides 0, 0, 1)
    has_sink = k_sink is not None
    if has_sink:
        k_sink, v_sink = k_sink.contiguous(), v_sink.contiguous()
    grid = (seqs, triton.cdiv(max_query_len, block_m), kv_heads)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_starts, starts, out, k_scale if has_scale else out,
        v_scale if has_scale else out, k_sink if has_sink else out, v_sink if has_sink else out,
        scale * LOG2E, sliding_window or NO_WINDOW,
        group, dim, q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        *(k_scale.stride() if has_scale else (0, 0, 0)), block_tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_G=block_g,
        BLOCK_D=max(16, triton.next_power_of_2(dim)), HAS_SCALE=has_scale, HAS_SINK=has_sink, num_warps=4)
    return out
