"""The kernels' public entry points: check the inputs, then run the Triton kernel or the torch
reference (backend.use_triton decides; the config's kernels=torch forces the reference).

    moe_align(topk_ids [T, k], experts, block_m, *, expert_offset=0) -> MoeAlignment
    grouped_gemm(a, w [E, N_w, K], align, *, gather, silu_mul, weights) -> [max_rows, N]
    unpermute_reduce(y [max_rows, N], align, *, weights=None) -> [T, N]
    rms_norm(x [..., H], weight [H], eps, *, residual=None) -> [..., H]
    rotary_(q [T, Hq, D], k [T, Hk, D], cos [T, D], sin [T, D]) -> None (in place)
    paged_decode_attention(q [S, Hq, D], k_cache, v_cache [B, bs, Hk, D], block_tables [S, M],
                           context_lens [S], *, scale=None, sliding_window=None) -> [S, Hq, D]
    paged_prefill_attention(q [T, Hq, D], k_cache, v_cache [B, bs, Hk, D], block_tables [S, M],
                            query_starts [S+1], starts [S], *, max_query_len=None, scale=None,
                            sliding_window=None) -> [T, Hq, D]
    mla_decode_attention(q [S, H, D], cache [B, bs, 1, D], block_tables [S, M], context_lens [S],
                         *, latent, scale, cache_scale=None) -> [S, H, latent]

Triton modules are imported inside the functions, on the Triton path only.
"""

from __future__ import annotations

import torch

from atoll.kernels import reference
from atoll.kernels.alignment import MoeAlignment
from atoll.kernels.backend import check, use_triton
from atoll.kernels.configs import GemmConfig, gemm_config

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
KV_QUANT = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)  # a quantized KV cache's storage


def _check_ids(topk_ids: torch.Tensor, experts: int, block_m: int) -> None:
    check(topk_ids.dim() == 2, f"topk_ids must be [tokens, top_k], got shape {tuple(topk_ids.shape)}")
    check(not topk_ids.is_floating_point(), f"topk_ids must be integer, got {topk_ids.dtype}")
    check(experts >= 1, f"experts={experts} must be at least 1")
    check(block_m >= 1 and block_m & (block_m - 1) == 0, f"block_m={block_m} must be a power of two")


def moe_align(topk_ids: torch.Tensor, experts: int, block_m: int, *, expert_offset: int = 0) -> MoeAlignment:
    """The expert-sorted, block-padded layout of the (token, slot) pairs (see alignment.py).
    Experts are local: global id g is local expert g - expert_offset when that is in
    [0, experts); other ids (another rank's experts, or negative "dropped" ids) are left out."""
    _check_ids(topk_ids, experts, block_m)
    if use_triton(topk_ids):
        from atoll.kernels.triton_moe_align import moe_align as run
        return run(topk_ids, experts, block_m, expert_offset=expert_offset)
    return reference.moe_align(topk_ids, experts, block_m, expert_offset=expert_offset)


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, align: MoeAlignment, *, gather: bool = False,
                 silu_mul: bool = False, weights: torch.Tensor | None = None,
                 config: GemmConfig | None = None) -> torch.Tensor:
    """Every row of the aligned layout times its expert's weight, in one launch.

    a: [tokens, K] when gather (row r reads token sorted_ids[r] // top_k), else [max_rows, K]
    in the aligned layout; w: [experts, N_w, K] in F.linear's [out, in] layout. silu_mul: w's
    rows are [gate (N); up (N)] and the result is silu(a @ gate^T) * (a @ up^T), [max_rows, N].
    weights: [tokens, top_k] routing weights multiplied into each row. Rows that hold no pair
    are 0 up to align.rows and unspecified past it. config: tile sizes (default: configs.py).
    """
    check(a.dtype in FLOATS and w.dtype == a.dtype, f"a and w must share a float dtype, got {a.dtype} and {w.dtype}")
    check(a.dim() == 2 and w.dim() == 3, f"a must be 2-D and w 3-D, got {a.dim()}-D and {w.dim()}-D")
    check(a.shape[1] == w.shape[2], f"a has K={a.shape[1]} columns but w has K={w.shape[2]}")
    check(w.shape[0] >= align.experts, f"w holds {w.shape[0]} experts, the alignment {align.experts}")
    check(not silu_mul or w.shape[1] % 2 == 0, f"silu_mul needs an even w.shape[1], got {w.shape[1]}")
    rows = align.tokens if gather else align.max_rows
    check(a.shape[0] == rows, f"a has {a.shape[0]} rows, expected {rows} ({'tokens' if gather else 'max_rows'})")
    if weights is not None:
        check(weights.numel() == align.pairs, f"weights has {weights.numel()} entries, expected {align.pairs} (tokens*top_k)")
    if use_triton(a, w):
        from atoll.kernels.triton_grouped_gemm import grouped_gemm as run
        return run(a, w, align, gather=gather, silu_mul=silu_mul, weights=weights,
                   config=config or gemm_config(align.block_m, silu_mul=silu_mul))
    return reference.grouped_gemm(a, w, align, gather=gather, silu_mul=silu_mul, weights=weights)


def unpermute_reduce(y: torch.Tensor, align: MoeAlignment, *, weights: torch.Tensor | None = None) -> torch.Tensor:
    """y: [max_rows, N] in the aligned layout -> [tokens, N], each token the sum of its local
    slots' rows (times weights [tokens, top_k] when given), accumulated in float32."""
    check(y.dim() == 2 and y.shape[0] == align.max_rows, f"y must be [{align.max_rows}, N], got {tuple(y.shape)}")
    if weights is not None:
        check(tuple(weights.shape) == (align.tokens, align.top_k),
              f"weights must be [{align.tokens}, {align.top_k}], got {tuple(weights.shape)}")
    if use_triton(y):
        from atoll.kernels.triton_unpermute import unpermute_reduce as run
        return run(y if y.stride(1) == 1 else y.contiguous(), align, weights=weights)
    return reference.unpermute_reduce(y, align, weights=weights)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last axis, in float32, as layers/norm.py. With residual (same shape and
    dtype as x), x + residual is normalised and also written into residual, in place."""
    h = x.shape[-1]
    check(weight.shape == (h,), f"weight must be [{h}], got {tuple(weight.shape)}")
    if residual is not None:
        check(residual.shape == x.shape and residual.dtype == x.dtype,
              f"residual must match x ({tuple(x.shape)}, {x.dtype}), got {tuple(residual.shape)}, {residual.dtype}")
    if not use_triton(x, weight):
        return reference.rms_norm(x, weight, eps, residual=residual)
    from atoll.kernels.triton_rms_norm import rms_norm as run
    x2 = x.reshape(-1, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    res2 = None
    if residual is not None:
        check(residual.is_contiguous(), "residual must be contiguous (it is written in place)")
        res2 = residual.view(-1, h)
    return run(x2, weight.contiguous(), eps, residual=res2).view(x.shape)


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] in place by
    cos/sin [tokens, head_dim] (RotaryEmbedding.cos_sin), the rotate_half convention."""
    if not torch.compiler.is_compiling():  # the messages format the token count: traced, it would be fixed
        _check_rotary(q, k, cos, sin)
    if not use_triton(q, k, cos, sin):
        return reference.rotary_(q, k, cos, sin)
    check(q.stride(2) == 1 and k.stride(2) == 1, "q and k need a contiguous head_dim axis for the Triton rotary")
    from atoll.kernels.triton_rotary import rotary_ as run
    run(q, k, cos if cos.stride(1) == 1 else cos.contiguous(), sin if sin.stride(1) == 1 else sin.contiguous())


def _check_rotary(q, k, cos, sin) -> None:
    check(q.dim() == 3 and k.dim() == 3, f"q and k must be [tokens, heads, head_dim], got {q.dim()}-D and {k.dim()}-D")
    tokens, _, dim = q.shape
    check(k.shape[0] == tokens and k.shape[2] == dim, f"k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    check(q.dtype == k.dtype, f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    check(dim % 2 == 0, f"head_dim={dim} must be even")
    check(cos.shape == (tokens, dim) and sin.shape == (tokens, dim),
          f"cos and sin must be [{tokens}, {dim}], got {tuple(cos.shape)} and {tuple(sin.shape)}")


def _check_tables(block_tables: torch.Tensor, context_lens: torch.Tensor, seqs: int, tensors) -> None:
    """A paged kernel's block tables and context lengths for `seqs` queries, on the device of
    its other `tensors`."""
    check(block_tables.dim() == 2 and block_tables.shape[0] == seqs,
          f"block_tables must be [seqs={seqs}, max_blocks], got {tuple(block_tables.shape)}")
    check(block_tables.dtype in (torch.int32, torch.int64),
          f"block_tables must be int32 or int64, got {block_tables.dtype}")
    check(context_lens.shape == (seqs,) and not context_lens.is_floating_point(),
          f"context_lens must be [seqs={seqs}] integers, got {tuple(context_lens.shape)} {context_lens.dtype}")
    devices = {t.device for t in (*tensors, block_tables, context_lens)}
    check(len(devices) == 1, f"all inputs must be on one device, got {', '.join(sorted(map(str, devices)))}")


def _check_kv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale, v_scale, k_sink=None,
              v_sink=None, *,
              rows: str) -> None:
    """q [rows, heads, head_dim] against a paged (possibly quantized) cache and its scales."""
    check(q.dim() == 3 and k_cache.dim() == 4,
          f"q must be [{rows}, heads, head_dim] and k_cache 4-D, got {q.dim()}-D and {k_cache.dim()}-D")
    _, heads, dim = q.shape
    check(v_cache.shape == k_cache.shape, f"v_cache {tuple(v_cache.shape)} does not match k_cache {tuple(k_cache.shape)}")
    check(k_cache.shape[3] == dim, f"the cache has head_dim={k_cache.shape[3]}, q has {dim}")
    check(heads % k_cache.shape[2] == 0, f"kv_heads={k_cache.shape[2]} does not divide heads={heads}")
    check(q.dtype in FLOATS and k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, *KV_QUANT),
          f"q, k_cache and v_cache must share a float dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype} "
          f"(or the cache one of int8, float8_e4m3fn, float8_e5m2)")
    check((k_scale is None) == (v_scale is None), "give k_scale and v_scale together")
    check(k_cache.dtype != torch.int8 or k_scale is not None, "an int8 cache needs k_scale and v_scale")
    check(k_scale is None or (k_scale.shape == v_scale.shape == k_cache.shape[:3]
                              and k_scale.dtype == v_scale.dtype == torch.float32),
          f"k_scale and v_scale must be float32 {tuple(k_cache.shape[:3])}, got "
          f"{None if k_scale is None else (tuple(k_scale.shape), k_scale.dtype)}")
    check((k_sink is None) == (v_sink is None), "give k_sink and v_sink together")
    check(k_sink is None or (k_sink.shape == v_sink.shape == k_cache.shape[2:]
                             and k_sink.dtype == v_sink.dtype == torch.float32),
          f"k_sink and v_sink must be float32 {tuple(k_cache.shape[2:])}, got "
          f"{None if k_sink is None else (tuple(k_sink.shape), k_sink.dtype)}")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, *,
                           scale: float | None = None, sliding_window: int | None = None,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           k_sink: torch.Tensor | None = None, v_sink: torch.Tensor | None = None) -> torch.Tensor:
    """One decode query per sequence over its paged cache -> [seqs, heads, head_dim] in q's dtype.

    q: [seqs, heads, head_dim]; k_cache, v_cache: [blocks, block_size, kv_heads, head_dim] (query
    head h reads kv head h // (heads // kv_heads)); block_tables: [seqs, max_blocks] int32/int64,
    the blocks of positions 0, bs, 2bs, ...; context_lens: [seqs] keys per sequence, the query's
    own (already in the cache) included; 0 gives a row of zeros. scale: default head_dim**-0.5.
    sliding_window: the query sees only the last sliding_window keys (None or 0: all), as
    transformers' Mistral/Qwen2. Each table must cover its context: not checked (a device sync).
    A quantized cache (layers/kv_quant.py): k_cache, v_cache in int8 or fp8 (e4m3fn, e5m2), read
    as value * scale with k_scale, v_scale [blocks, block_size, kv_heads] float32 (required for
    int8; fp8 e4m3's scale per kv head as a view of that shape, strides 0, 0, 1; None: 1), and
    fp8 e4m3's k_sink, v_sink [kv_heads, head_dim] float32, added to each sequence's position 0
    (None: 0).
    """
    _check_kv(q, k_cache, v_cache, k_scale, v_scale, k_sink, v_sink, rows="seqs")
    seqs, _, dim = q.shape
    _check_tables(block_tables, context_lens, seqs, (q, k_cache, v_cache))
    check(sliding_window is None or sliding_window >= 0,
          f"sliding_window={sliding_window} must be >= 0 or None (0: no window)")
    scale = dim**-0.5 if scale is None else scale
    if not use_triton(q, k_cache, v_cache, block_tables, context_lens):
        return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                                scale=scale, sliding_window=sliding_window, k_scale=k_scale,
                                                v_scale=v_scale, k_sink=k_sink, v_sink=v_sink)
    from atoll.kernels.triton_paged_attention import paged_decode_attention as run
    q, k_cache, v_cache, block_tables = (t if t.stride(-1) == 1 else t.contiguous()
                                         for t in (q, k_cache, v_cache, block_tables))
    return run(q, k_cache, v_cache, block_tables, context_lens.contiguous(), scale=scale,
               sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale, k_sink=k_sink, v_sink=v_sink)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_starts: torch.Tensor, starts: torch.Tensor, *,
                            max_query_len: int | None = None, scale: float | None = None,
                            sliding_window: int | None = None, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None, k_sink: torch.Tensor | None = None,
                            v_sink: torch.Tensor | None = None) -> torch.Tensor:
    """A prefill step's new tokens over their sequences' paged cache -> [tokens, heads, head_dim]
    in q's dtype.

    q: [tokens, heads, head_dim], every sequence's new tokens back to back: sequence i's are rows
    query_starts[i] .. query_starts[i + 1] ([seqs + 1] integers, from 0 to tokens), at positions
    starts[i], starts[i] + 1, ... ([seqs] integers: positions cached before the step). Their keys
    and values must already be in the cache. Each token attends causally to its sequence's keys
    up to its own position, and to the last sliding_window of them when one is given (None or 0:
    all), as attend's prefill branch. k_cache, v_cache, block_tables, scale, k_scale, v_scale, k_sink, v_sink: as
    paged_decode_attention's (a quantized cache included). max_query_len: the longest chunk (the
    kernel's grid); None reads it from query_starts (a device sync). Not checked (a device sync
    each): query_starts ascending and ending at tokens, each table covering its positions.
    """
    _check_kv(q, k_cache, v_cache, k_scale, v_scale, k_sink, v_sink, rows="tokens")
    check(starts.dim() == 1 and not starts.is_floating_point(),
          f"starts must be [seqs] integers, got {tuple(starts.shape)} {starts.dtype}")
    seqs, dim = starts.shape[0], q.shape[2]
    check(query_starts.shape == (seqs + 1,) and not query_starts.is_floating_point(),
          f"query_starts must be [seqs + 1={seqs + 1}] integers, got {tuple(query_starts.shape)} {query_starts.dtype}")
    _check_tables(block_tables, starts, seqs, (q, k_cache, v_cache, query_starts))
    check(sliding_window is None or sliding_window >= 0,
          f"sliding_window={sliding_window} must be >= 0 or None (0: no window)")
    check(max_query_len is None or 0 <= max_query_len <= q.shape[0],
          f"max_query_len={max_query_len} must be in [0, tokens={q.shape[0]}]")
    scale = dim**-0.5 if scale is None else scale
    if not use_triton(q, k_cache, v_cache, block_tables, query_starts, starts):
        return reference.paged_prefill_attention(q, k_cache, v_cache, block_tables, query_starts, starts,
                                                 scale=scale, sliding_window=sliding_window, k_scale=k_scale,
                                                 v_scale=v_scale, k_sink=k_sink, v_sink=v_sink)
    from atoll.kernels.triton_paged_prefill import paged_prefill_attention as run
    if max_query_len is None:
        max_query_len = int(query_starts.diff().max()) if seqs else 0
    q, k_cache, v_cache, block_tables = (t if t.stride(-1) == 1 else t.contiguous()
                                         for t in (q, k_cache, v_cache, block_tables))
    return run(q, k_cache, v_cache, block_tables, query_starts.contiguous(), starts.contiguous(),
               max_query_len=max_query_len, scale=scale, sliding_window=sliding_window, k_scale=k_scale,
               v_scale=v_scale, k_sink=k_sink, v_sink=v_sink)


def mla_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, *, latent: int, scale: float,
                         cache_scale: torch.Tensor | None = None) -> torch.Tensor:
    """MLA's absorbed decode (layers/mla.py), one query per sequence -> [seqs, heads, latent].

    q: [seqs, heads, D], each head's [W_uk^T q_nope, rope(q_rope)], D = kv_lora_rank + rope;
    cache: [blocks, block_size, 1, D], the latent vectors [c, k_r], every head's key, whose first
    `latent` values are the value; block_tables, context_lens: as paged_decode_attention's (0
    keys give a row of zeros). A quantized cache: int8 (cache_scale [blocks, block_size, 1]
    float32, required), fp8 e4m3fn (its one scale as a view of that shape, or None: 1) or e5m2
    (cache_scale None).
    """
    check(q.dim() == 3 and cache.dim() == 4,
          f"q must be [seqs, heads, D] and cache 4-D, got {q.dim()}-D and {cache.dim()}-D")
    seqs, heads, dim = q.shape
    check(cache.shape[2] == 1, f"the latent cache has one head, got {cache.shape[2]}")
    check(cache.shape[3] == dim, f"the cache has D={cache.shape[3]}, q has {dim}")
    check(0 < latent <= dim, f"latent={latent} must be in 1..D={dim}")
    check(q.dtype in FLOATS and cache.dtype in (q.dtype, *KV_QUANT),
          f"q and cache must share a float dtype, got {q.dtype} and {cache.dtype} "
          f"(or the cache one of int8, float8_e4m3fn, float8_e5m2)")
    check(cache.dtype != torch.int8 or cache_scale is not None, "an int8 cache needs cache_scale")
    check(cache_scale is None or (cache_scale.shape == cache.shape[:3] and cache_scale.dtype == torch.float32),
          f"cache_scale must be float32 {tuple(cache.shape[:3])}, got "
          f"{None if cache_scale is None else (tuple(cache_scale.shape), cache_scale.dtype)}")
    _check_tables(block_tables, context_lens, seqs, (q, cache))
    if not use_triton(q, cache, block_tables, context_lens):
        return reference.mla_decode_attention(q, cache, block_tables, context_lens, latent=latent, scale=scale,
                                              cache_scale=cache_scale)
    from atoll.kernels.triton_mla_decode import mla_decode_attention as run
    q, cache, block_tables = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, cache, block_tables))
    if cache_scale is not None and cache_scale.stride(-1) != 1:  # (e4m3's scale is a view, strides 0, 0, 1: kept)
        cache_scale = cache_scale.contiguous()
    return run(q, cache, block_tables, context_lens.contiguous(), latent=latent, scale=scale,
               cache_scale=cache_scale)
