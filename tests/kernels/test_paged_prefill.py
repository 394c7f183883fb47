"""paged_prefill_attention: the torch reference against dense causal attention and against the
prefill branch of attend (layers/attention.py), and the Triton kernel against the reference, in
Triton's interpreter on CPU (compiled on a GPU). The interpreter setup lives in test_kernels.py;
its fresh-process rerun covers only test_kernels*.py, so this file has its own."""

import os
import subprocess
import sys

import pytest
import torch
from test_kernels import DEVICE, IN_PROCESS, TOL, assert_close, triton_path  # noqa: F401  (triton_path: fixture)
from test_paged_attention import paged_batch, padded

from atoll.kernels import backend, ops, reference
from atoll.kernels.backend import KernelError
from atoll.layers.attention import AttentionMetadata, attend
from atoll.layers.kv_quant import QuantizedKV, kv_format, quantize


def prefill_batch(starts, chunks, heads, kv_heads, dim, block_size, *, dtype=torch.float32, seed=0, extra=0):
    """q [sum(chunks), heads, dim] and a random paged cache covering starts[i] + chunks[i]
    (+ extra) positions per sequence; the padded tables, query_starts [seqs + 1] and starts [seqs]."""
    total = [s + n + extra for s, n in zip(starts, chunks)]
    _, k_cache, v_cache, tables = paged_batch(total, heads, kv_heads, dim, block_size, dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(chunks), heads, dim, generator=g).to(dtype)
    bounds = [0]
    for n in chunks:
        bounds.append(bounds[-1] + n)
    return q, k_cache, v_cache, padded(tables), torch.tensor(bounds), torch.tensor(starts)


def dense(q, k_cache, v_cache, tables, bounds, starts, window=None, scale=None):
    """The definition, one query row at a time: softmax(q k^T * scale) v over the row's keys."""
    _, bs, kv_heads, dim = k_cache.shape
    group = q.shape[1] // kv_heads
    scale = dim**-0.5 if scale is None else scale
    out = torch.zeros_like(q)
    for i, start in enumerate(starts.tolist()):
        for t in range(int(bounds[i]), int(bounds[i + 1])):
            pos = start + t - int(bounds[i])
            keys = [p for p in range(pos + 1) if not window or p > pos - window]
            rows = [(int(tables[i, p // bs]), p % bs) for p in keys]
            k = torch.stack([k_cache[b, o] for b, o in rows])  # [keys, kv_heads, dim]
            v = torch.stack([v_cache[b, o] for b, o in rows])
            for h in range(q.shape[1]):
                w = torch.softmax(k[:, h // group] @ q[t, h] * scale, dim=0)
                out[t, h] = w @ v[:, h // group]
    return out


# starts (cached positions) and chunk lengths: a fresh sequence, a 1-token chunk, chunks over
# block edges and several blocks
STARTS, CHUNKS = [0, 21, 5, 40], [13, 1, 30, 9]


# --- the reference ---

@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2)], ids=["gqa2", "mha"])
@pytest.mark.parametrize("window", [None, 6], ids=lambda w: f"window{w}")
def test_reference_is_dense_attention(heads, kv_heads, window):
    q, k_cache, v_cache, tables, bounds, starts = prefill_batch(STARTS, CHUNKS, heads, kv_heads, 16, 8)
    out = reference.paged_prefill_attention(q, k_cache, v_cache, tables, bounds, starts, sliding_window=window)
    torch.testing.assert_close(out, dense(q, k_cache, v_cache, tables, bounds, starts, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 6], ids=lambda w: f"window{w}")
def test_reference_is_attend_prefill(window):
    q, k_cache, v_cache, tables, bounds, starts = prefill_batch(STARTS, CHUNKS, 4, 2, 16, 8)
    rows = [t[:-(-(s + n) // 8)] for t, s, n in zip(tables.tolist(), STARTS, CHUNKS)]
    meta = AttentionMetadata.build(rows, STARTS, CHUNKS, 8)
    want = attend(q, k_cache, v_cache, meta, sliding_window=window)
    out = reference.paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_starts(),
                                            meta.starts, sliding_window=window)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(ops.paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_starts(),
                                                   meta.starts, sliding_window=window), out)  # CPU: the reference


# --- the Triton kernel against the reference ---

# heads, kv_heads, block_size, window, scale, starts, chunks
CASES = [
    (4, 2, 16, None, None, STARTS, CHUNKS),
    (2, 2, 32, None, 0.1, [33, 0], [3, 70]),     # MHA, block_size 32, a given scale, 2 query tiles of 64
    (4, 1, 16, 7, None, [0, 18, 3], [20, 1, 5]),  # window mid-block and before key 0; group 4
]
IDS = [f"h{h}-kv{k}-bs{bs}-w{w}" for h, k, bs, w, _, _, _ in CASES]


def _on_device(*ts):
    return [t.to(DEVICE) for t in ts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,block_size,window,scale,starts,chunks", CASES, ids=IDS)
def test_kernel_matches_reference(triton_path, dtype, heads, kv_heads, block_size, window, scale, starts, chunks):
    q, k_cache, v_cache, tables, bounds, first = _on_device(
        *prefill_batch(starts, chunks, heads, kv_heads, 64, block_size, dtype=dtype))
    if block_size == 32:
        tables = tables.int()
    out = ops.paged_prefill_attention(q, k_cache, v_cache, tables, bounds, first, max_query_len=max(chunks),
                                      scale=scale, sliding_window=window)
    # the kernel's math: float32 throughout, one rounding to the output dtype
    want = reference.paged_prefill_attention(q.float(), k_cache.float(), v_cache.float(), tables, bounds, first,
                                             scale=scale or 64**-0.5, sliding_window=window).to(dtype)
    assert_close(out, want, TOL[dtype])


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8_e4m3", "fp8_e4m3-scaled"])
def test_kernel_reads_a_quantized_cache(triton_path, cache_dtype):
    """e4m3 "-scaled": a scale per kv head (2**-2, 2**-6), passed as a view of strides (0, 0, 1), and
    sinks added back at each sequence's position 0."""
    q, k_cache, v_cache, tables, bounds, starts = prefill_batch([4, 0], [6, 17], 4, 2, 64, 16)
    fmt = kv_format(cache_dtype.removesuffix("-scaled"))
    (kq, ks), (vq, vs) = quantize(k_cache, fmt), quantize(v_cache, fmt)
    if cache_dtype.endswith("-scaled"):
        head = torch.tensor([2.0**-2, 2.0**-6])
        (kq, _), (vq, _) = quantize(k_cache * head[:, None], fmt, head), quantize(v_cache * head[:, None], fmt, head)
        ks = vs = head.to(DEVICE).expand(kq.shape[:3])
    sinks = {}
    if cache_dtype.endswith("-scaled"):
        g = torch.Generator().manual_seed(7)
        sinks = dict(k_sink=torch.randn(2, 64, generator=g).to(DEVICE), v_sink=torch.randn(2, 64, generator=g).to(DEVICE))
    q, kq, vq, tables, bounds, starts = _on_device(q, kq, vq, tables, bounds, starts)
    ks, vs = (None, None) if ks is None else _on_device(ks, vs)
    out = ops.paged_prefill_attention(q, kq, vq, tables, bounds, starts, k_scale=ks, v_scale=vs, **sinks)
    want = reference.paged_prefill_attention(q, kq, vq, tables, bounds, starts, scale=64**-0.5, k_scale=ks,
                                             v_scale=vs, **sinks)
    assert_close(out, want)
    if sinks:  # the sinks are read (the sequence starting at 0 sees its own position 0)
        assert not torch.allclose(ops.paged_prefill_attention(q, kq, vq, tables, bounds, starts, k_scale=ks,
                                                              v_scale=vs), want, atol=1e-3)


def test_attend_prefill_takes_the_kernel(triton_path):
    """attend's non-decode step on the Triton path: the kernel, over a plain and a quantized cache."""
    q, k_cache, v_cache, tables, _, _ = prefill_batch([0, 9], [5, 4], 4, 2, 64, 16)
    rows = [t[:-(-(s + n) // 16)] for t, s, n in zip(tables.tolist(), [0, 9], [5, 4])]
    meta = AttentionMetadata.build(rows, [0, 9], [5, 4], 16)
    with backend.using("torch"):
        want = attend(q, k_cache, v_cache, meta)
    assert_close(attend(q, k_cache, v_cache, meta), want)
    assert "query_starts" in meta._memo  # built once for the step
    caches = []
    for x in (k_cache, v_cache):
        c = QuantizedKV(tuple(x.shape), kv_format("int8"), torch.float32)
        c.data, c.scale = quantize(x, c.format)
        caches.append(c)
    with backend.using("torch"):
        want = attend(q, *caches, meta)
    assert_close(attend(q, *caches, meta), want)


def test_an_off_by_one_mask_fails_the_comparison(triton_path):
    """The comparison is sharp enough to catch a causal mask off by one: the kernel told every
    sequence has one more cached position (so each token also sees the key after its own)."""
    q, k_cache, v_cache, tables, bounds, starts = _on_device(
        *prefill_batch([0, 3], [9, 4], 2, 2, 64, 16, extra=1))
    want = reference.paged_prefill_attention(q, k_cache, v_cache, tables, bounds, starts)
    assert_close(ops.paged_prefill_attention(q, k_cache, v_cache, tables, bounds, starts), want)
    with pytest.raises(AssertionError):
        assert_close(ops.paged_prefill_attention(q, k_cache, v_cache, tables, bounds, starts + 1), want)


def test_input_errors_name_the_numbers():
    q, k_cache, v_cache, tables, bounds, starts = prefill_batch([2, 0], [3, 4], 4, 2, 16, 4)
    with pytest.raises(KernelError, match=r"query_starts must be \[seqs \+ 1=3\] integers, got \(2,\)"):
        ops.paged_prefill_attention(q, k_cache, v_cache, tables, bounds[:2], starts)
    with pytest.raises(KernelError, match=r"starts must be \[seqs\] integers, got \(2, 1\)"):
        ops.paged_prefill_attention(q, k_cache, v_cache, tables, bounds, starts[:, None])
    with pytest.raises(KernelError, match=r"block_tables must be \[seqs=2, max_blocks\], got \(3, 2\)"):
        ops.paged_prefill_attention(q, k_cache, v_cache, torch.zeros(3, 2, dtype=torch.long), bounds, starts)
    with pytest.raises(KernelError, match=r"kv_heads=2 does not divide heads=3"):
        ops.paged_prefill_attention(q[:, :3], k_cache, v_cache, tables, bounds, starts)
    with pytest.raises(KernelError, match=r"max_query_len=9 must be in \[0, tokens=7\]"):
        ops.paged_prefill_attention(q, k_cache, v_cache, tables, bounds, starts, max_query_len=9)


@pytest.mark.skipif(IN_PROCESS, reason="triton's interpreter is usable in this process")
@pytest.mark.timeout(300)
def test_paged_prefill_in_fresh_process():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.basename(__file__)],
                       cwd=os.path.dirname(__file__), env=env, capture_output=True, text=True, timeout=290)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
