"""Torch references of every kernel: the CPU path, and what the Triton kernels are tested
against. Each function here has the signature of its dispatcher in ops.py / moe.py.

Precision: grouped_gemm and unpermute_reduce define the kernels' math (float32 accumulation,
float32 epilogue, one rounding to the output dtype). rms_norm and rotary_ compute exactly what
layers/norm.py and layers/rotary.py compute. fused_moe follows transformers' MixtralExperts
(matmuls in the input dtype) but sums the top-k contributions in float32.
paged_decode_attention computes what the decode branch of layers/attention.py's attend
computes, in the input dtype (its kernel keeps float32 until one rounding: test it against
the reference run on float32 copies). mla_decode_attention computes what layers/mla.py's
absorbed decode computes over the latent cache, in the same way. paged_prefill_attention
computes what the non-decode branch of attend computes (a loop over sequences), in the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atoll.kernels.alignment import MoeAlignment, max_rows


def moe_align(topk_ids: torch.Tensor, experts: int, block_m: int, *, expert_offset: int = 0) -> MoeAlignment:
    """topk_ids: [tokens, top_k] global expert ids; this rank holds experts
    [expert_offset, expert_offset + experts)."""
    tokens, top_k = topk_ids.shape
    pairs = tokens * top_k
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).long() - expert_offset
    local = (ids >= 0) & (ids < experts)
    key = torch.where(local, ids, torch.full_like(ids, experts))  # non-local pairs sort last
    counts = torch.bincount(key, minlength=experts + 1)[:experts]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.argsort(key, stable=True)[: int(local.sum())]  # local pairs, by expert then i
    e = key[order]
    first = counts.cumsum(0) - counts  # index in `order` of each expert's first pair
    pos = starts[e] + torch.arange(order.numel(), device=dev) - first[e]

    n_rows = max_rows(pairs, experts, block_m)
    sorted_ids = torch.full((n_rows,), pairs, dtype=torch.int32, device=dev)
    sorted_ids[pos] = order.to(torch.int32)
    position = torch.full((pairs,), -1, dtype=torch.int32, device=dev)
    position[order] = pos.to(torch.int32)
    used = int(padded.sum())
    block_start = torch.arange(0, n_rows, block_m, device=dev)
    block_expert = torch.searchsorted(ends, block_start, right=True).to(torch.int32)
    block_expert[block_start >= used] = -1
    rows = torch.tensor([used], dtype=torch.int32, device=dev)
    return MoeAlignment(sorted_ids, block_expert, rows, position, block_m, top_k, experts)


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, align: MoeAlignment, *, gather: bool = False,
                 silu_mul: bool = False, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Row r of the aligned layout times its block's expert weight.

    a: [tokens, K] read at row sorted_ids[r] // top_k (gather) or [max_rows, K] read at row r;
    w: [experts, N_w, K] (F.linear layout); silu_mul: N_w = 2N as [gate; up] and the row is
    silu(gate) * up; weights: [tokens, top_k] routing weights, multiplied into row r as
    weights.flat[sorted_ids[r]]. Returns [max_rows, N]; rows without a pair are 0.
    """
    n = w.shape[1] // 2 if silu_mul else w.shape[1]
    out = torch.zeros(align.max_rows, n, dtype=a.dtype, device=a.device)
    rows = align.valid_rows().nonzero().squeeze(1)
    pair = align.sorted_ids[rows].long()
    src = a[pair // align.top_k] if gather else a[rows]
    expert = align.block_expert[rows // align.block_m].long()
    for e in expert.unique().tolist():
        sel = expert == e
        y = F.linear(src[sel].float(), w[e].float())
        if silu_mul:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        if weights is not None:
            y = y * weights.reshape(-1)[pair[sel]].float()[:, None]
        out[rows[sel]] = y.to(a.dtype)
    return out


def unpermute_reduce(y: torch.Tensor, align: MoeAlignment, *, weights: torch.Tensor | None = None) -> torch.Tensor:
    """y: [max_rows, N] in the aligned layout -> [tokens, N]: out[t] = sum over the slots j of
    token t whose expert is local of (weights[t, j] *) y[position[t * top_k + j]]."""
    pos = align.position.view(align.tokens, align.top_k).long()
    keep = (pos >= 0).float()
    if weights is not None:
        keep = keep * weights.float()
    rows = y[pos.clamp(min=0)].float()  # [tokens, top_k, N]
    return (rows * keep[..., None]).sum(1).to(y.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x (or of x + residual, which is then written into residual)."""
    if residual is not None:
        x = x + residual  # rounded to the residual stream's dtype, as the model adds it
        residual.copy_(x)
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def _joined(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(q and k as one [tokens, heads + kv_heads, head_dim] view) when k's heads follow q's
    in one buffer, as the QKV projection's split leaves them; else (q, k). Exact: the same
    storage (two separate tensors the allocator happened to place end to end are not one
    buffer), k's storage offset where q's heads end, the same strides, rows that do not
    overlap, and the joined view inside the storage."""
    tokens, heads, dim = q.shape
    if torch.compiler.is_compiling():  # a compiled graph fuses the two anyway (data_ptr is not traceable)
        return q, k
    kv = k.shape[1]
    if (tokens == 0 or k.dim() != 3 or k.shape[0] != tokens or k.shape[2] != dim or k.dtype != q.dtype
            or q.stride()[1:] != (dim, 1) or k.stride()[1:] != (dim, 1)
            or (tokens > 1 and (q.stride(0) != k.stride(0) or q.stride(0) < (heads + kv) * dim))):
        return q, k
    qs, ks = q.untyped_storage(), k.untyped_storage()
    if qs.data_ptr() != ks.data_ptr() or qs.nbytes() != ks.nbytes():
        return q, k  # not one storage
    if k.storage_offset() != q.storage_offset() + heads * dim:
        return q, k
    last = q.storage_offset() + (tokens - 1) * q.stride(0) + (heads + kv) * dim  # one past the end
    if last * q.element_size() > qs.nbytes():
        return q, k
    return (q.as_strided((tokens, heads + kv, dim), q.stride()),)


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place: q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim],
    cos/sin: [tokens, head_dim] (cat(freqs, freqs), already scaled and cast).
    x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1) written as
    roll(x) * cat(-sin1, sin2): the same products and sums, bit for bit, in fewer ops."""
    half = q.shape[-1] // 2
    c = cos[:, None, :]
    s = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None, :]
    for x in _joined(q, k):
        x.copy_(x * c + x.roll(half, dims=-1) * s)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, *, expert_offset: int = 0) -> torch.Tensor:
    """x: [tokens, hidden]; w13: [experts, 2*inter, hidden] as [gate; up]; w2: [experts,
    hidden, inter]; topk_ids/topk_weights: [tokens, top_k] -> [tokens, hidden]."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    ids = topk_ids.long() - expert_offset
    for e in ids.unique().tolist():
        if not 0 <= e < w13.shape[0]:
            continue  # another rank's expert, or a dropped (negative) id
        token, slot = torch.where(ids == e)
        gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        out.index_add_(0, token, y.float() * topk_weights[token, slot, None].float())
    return out.to(x.dtype)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, *,
                           scale: float | None = None, sliding_window: int | None = None,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           k_sink: torch.Tensor | None = None, v_sink: torch.Tensor | None = None) -> torch.Tensor:
    """q: [seqs, heads, head_dim], one query per sequence at position context_lens - 1;
    k_cache/v_cache: [blocks, block_size, kv_heads, head_dim]; block_tables: [seqs, max_blocks];
    context_lens: [seqs] keys per sequence (the query's own included). The blocks up to the
    longest context are gathered (index_select) and masked, as attend's decode branch does;
    a sequence with no keys gives zeros. A quantized cache (int8/fp8) is read as float32 value
    times k_scale/v_scale [blocks, block_size, kv_heads] (None: 1), plus k_sink/v_sink
    [kv_heads, head_dim] at each sequence's position 0 (fp8 e4m3's), then cast to q's dtype."""
    seqs, _, dim = q.shape
    _, bs, kv_heads, _ = k_cache.shape
    ctx = context_lens.to(q.device, torch.long)
    longest = int(ctx.max()) if seqs else 0
    if longest == 0:
        return torch.zeros_like(q)
    blocks = -(-longest // bs)
    ids = block_tables[:, :blocks].to(q.device, torch.long).reshape(-1)
    # [seqs*blocks, block_size, kv_heads, head_dim] -> [seqs, kv_heads, blocks*block_size, head_dim]
    k, v = (_with_sink(_dequantized(c, s, ids, q.dtype).view(seqs, blocks * bs, kv_heads, dim), sink).transpose(1, 2)
            for c, s, sink in ((k_cache, k_scale, k_sink), (v_cache, v_scale, v_sink)))
    keys = torch.arange(blocks * bs, device=q.device)
    mask = keys[None, :] < ctx[:, None]  # [seqs, keys]
    if sliding_window:
        mask &= keys[None, :] > ctx[:, None] - 1 - sliding_window
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask[:, None, None, :],
                                         scale=scale, enable_gqa=q.shape[1] != kv_heads)[:, :, 0]
    return out.masked_fill((ctx == 0)[:, None, None], 0.0)  # an all-masked row: 0, whatever the backend


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_starts: torch.Tensor, starts: torch.Tensor, *,
                            max_query_len: int | None = None, scale: float | None = None,
                            sliding_window: int | None = None, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None, k_sink: torch.Tensor | None = None,
                            v_sink: torch.Tensor | None = None) -> torch.Tensor:
    """q: [tokens, heads, head_dim], sequence i's new tokens at rows query_starts[i] ..
    query_starts[i + 1], positions starts[i], starts[i] + 1, ... (their keys already in the
    cache); k_cache/v_cache, block_tables, k_scale/v_scale as paged_decode_attention's. Per
    sequence, its blocks are gathered and SDPA runs with the causal (and window) mask, as
    attend's prefill branch does. max_query_len: unused (the kernel's grid)."""
    out = torch.zeros_like(q)
    _, bs, kv_heads, dim = k_cache.shape
    bounds, first = query_starts.tolist(), starts.tolist()
    for i, start in enumerate(first):
        lo, hi = bounds[i], bounds[i + 1]
        if hi == lo:
            continue
        length = start + hi - lo
        ids = block_tables[i, :-(-length // bs)].to(q.device, torch.long)
        k, v = (_with_sink(_dequantized(c, s, ids, q.dtype).reshape(1, -1, kv_heads, dim), sink)[0, :length]
                .transpose(0, 1)[None] for c, s, sink in ((k_cache, k_scale, k_sink), (v_cache, v_scale, v_sink)))
        pos = torch.arange(start, length, device=q.device)[:, None]
        keys = torch.arange(length, device=q.device)[None, :]
        mask = keys <= pos
        if sliding_window:
            mask &= keys > pos - sliding_window
        o = F.scaled_dot_product_attention(q[lo:hi].transpose(0, 1)[None], k, v, attn_mask=mask[None, None],
                                           scale=scale, enable_gqa=q.shape[1] != kv_heads)
        out[lo:hi] = o[0].transpose(0, 1)
    return out


def _with_sink(x: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """x: [seqs, keys, kv_heads, dim] from each sequence's position 0; the sink added there
    (in float32, one rounding), as layers/attention.gather_blocks does."""
    if sink is not None and x.shape[0]:
        x[:, 0] = (x[:, 0].float() + sink.to(x.device)).to(x.dtype)
    return x


def _dequantized(cache: torch.Tensor, scale: torch.Tensor | None, ids: torch.Tensor, dtype) -> torch.Tensor:
    """Blocks ids of a cache in `dtype`: as stored, or a quantized one's value x scale in float32."""
    x = cache.index_select(0, ids)
    if x.dtype == dtype:
        return x
    x = x.float()
    if scale is not None:
        x = x * scale.index_select(0, ids)[..., None]
    return x.to(dtype)


def mla_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, *, latent: int, scale: float,
                         cache_scale: torch.Tensor | None = None) -> torch.Tensor:
    """MLA's absorbed decode. q: [seqs, heads, D], D = kv_lora_rank + rope; cache: [blocks,
    block_size, 1, D], one latent vector per token that every head reads as its key, its first
    `latent` values the value; block_tables, context_lens as paged_decode_attention's. The blocks
    up to the longest context are gathered and masked -> [seqs, heads, latent] in q's dtype; a
    sequence with no keys gives zeros. A quantized cache is read as float32 value times
    cache_scale [blocks, block_size, 1] (None: 1), then cast to q's dtype."""
    seqs, heads, dim = q.shape
    bs = cache.shape[1]
    ctx = context_lens.to(q.device, torch.long)
    longest = int(ctx.max()) if seqs else 0
    if longest == 0:
        return q.new_zeros(seqs, heads, latent)
    blocks = -(-longest // bs)
    ids = block_tables[:, :blocks].to(q.device, torch.long).reshape(-1)
    # [seqs*blocks, block_size, 1, D] -> [seqs, 1, blocks*block_size, D]
    kv = _dequantized(cache, cache_scale, ids, q.dtype).view(seqs, blocks * bs, 1, dim).transpose(1, 2)
    mask = torch.arange(blocks * bs, device=q.device)[None, :] < ctx[:, None]  # [seqs, keys]
    out = F.scaled_dot_product_attention(q[:, :, None], kv, kv[..., :latent], attn_mask=mask[:, None, None, :],
                                         scale=scale, enable_gqa=heads > 1)[:, :, 0]
    return out.masked_fill((ctx == 0)[:, None, None], 0.0)  # an all-masked row: 0, whatever the backend
