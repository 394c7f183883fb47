"""paged_decode_attention: the torch reference against the decode branch of attend
(layers/attention.py), and the Triton kernel against the reference, in Triton's interpreter on
CPU (compiled on a GPU). The interpreter setup lives in test_kernels.py; its fresh-process rerun
covers only test_kernels*.py, so this file has its own."""

import os
import subprocess
import sys

import pytest
import torch

from test_kernels import DEVICE, IN_PROCESS, TOL, assert_close, triton_path  # noqa: F401  (triton_path: fixture)

from atoll.kernels import ops, reference  # noqa: E402
from atoll.kernels.backend import KernelError  # noqa: E402
from atoll.layers.attention import AttentionMetadata, attend  # noqa: E402


def paged_batch(context_lens, heads, kv_heads, dim, block_size, *, dtype=torch.float32, seed=0, spare=3):
    """q [seqs, heads, dim], a cache of random blocks, and per-sequence block-id lists just long
    enough for each context: the ids shuffled over the whole cache (block 0, the tables'
    padding, belongs to some sequence too), with `spare` blocks no sequence uses."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in context_lens]
    blocks = sum(need) + spare
    ids = torch.randperm(blocks, generator=g).tolist()
    tables, used = [], 0
    for n in need:
        tables.append(ids[used:used + n])
        used += n
    shape = (blocks, block_size, kv_heads, dim)
    k_cache, v_cache = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    q = torch.randn(len(context_lens), heads, dim, generator=g)
    return q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), tables


def padded(tables, dtype=torch.long):
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=dtype)


# --- the reference is attend's decode step ---

@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)], ids=["gqa4", "mha"])
@pytest.mark.parametrize("window", [None, 3, 20], ids=lambda w: f"window{w}")
def test_reference_is_attend_decode(heads, kv_heads, window):
    ctx = [1, 37, 16, 50, 9]  # ragged: within one block, block edges, several blocks
    q, k_cache, v_cache, tables = paged_batch(ctx, heads, kv_heads, 32, 8)
    meta = AttentionMetadata.build(tables, [n - 1 for n in ctx], [1] * len(ctx), 8)
    want = attend(q, k_cache, v_cache, meta, sliding_window=window)
    out = reference.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, torch.tensor(ctx),
                                           sliding_window=window)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(ops.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, torch.tensor(ctx),
                                                  sliding_window=window), out)  # CPU: the dispatcher's path


def test_reference_zero_length_rows_are_zero():
    q, k_cache, v_cache, tables = paged_batch([0, 5, 0], 4, 2, 16, 4)
    out = reference.paged_decode_attention(q, k_cache, v_cache, padded([t or [0] for t in tables]),
                                           torch.tensor([0, 5, 0]))
    assert torch.equal(out[[0, 2]], torch.zeros(2, 4, 16)) and out[1].abs().sum() > 0
    none = reference.paged_decode_attention(q, k_cache, v_cache, torch.zeros(3, 1, dtype=torch.long),
                                            torch.zeros(3, dtype=torch.long))
    assert torch.equal(none, torch.zeros_like(q))


# --- the Triton kernel against the reference ---

# heads, kv_heads, head_dim, block_size, window, scale, contexts (0: a padding row)
CASES = [
    (8, 2, 64, 16, None, None, [33, 0, 1, 16]),
    (4, 4, 80, 16, None, None, [20, 47, 0]),
    (8, 2, 80, 16, 5, None, [40, 0, 3, 17]),    # window starts mid-block, and before key 0
    (2, 2, 64, 32, 40, 0.1, [70, 5, 0]),        # block_size 32, int32 tables, a given scale
]
IDS = [f"h{h}-kv{k}-d{d}-bs{bs}-w{w}" for h, k, d, bs, w, _, _ in CASES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,dim,block_size,window,scale,ctx", CASES, ids=IDS)
def test_kernel_matches_reference(triton_path, dtype, heads, kv_heads, dim, block_size, window, scale, ctx):
    q, k_cache, v_cache, tables = paged_batch(ctx, heads, kv_heads, dim, block_size, dtype=dtype)
    table_dtype = torch.int32 if block_size == 32 else torch.long
    tables = padded([t or [0] for t in tables], table_dtype).to(DEVICE)
    lens = torch.tensor(ctx, device=DEVICE)
    q, k_cache, v_cache = q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE)
    out = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale=scale, sliding_window=window)
    # the kernel's math: float32 throughout, one rounding to the output dtype
    want = reference.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), tables, lens,
                                            scale=scale or dim**-0.5, sliding_window=window).to(dtype)
    assert_close(out, want, TOL[dtype])
    zero = [i for i, n in enumerate(ctx) if n == 0]
    assert torch.equal(out[zero], torch.zeros_like(out[zero]))  # no NaN from a padding row


def test_kernel_reads_a_strided_q(triton_path):
    """q as the view the QKV split leaves (rows strided by the fused width)."""
    ctx = [19, 4]
    q, k_cache, v_cache, tables = paged_batch(ctx, 4, 2, 64, 16)
    qkv = torch.cat([q.flatten(1), torch.randn(2, 2 * 2 * 64)], dim=1).to(DEVICE)
    q_view = qkv[:, : 4 * 64].view(2, 4, 64)
    tables, lens = padded(tables).to(DEVICE), torch.tensor(ctx, device=DEVICE)
    out = ops.paged_decode_attention(q_view, k_cache.to(DEVICE), v_cache.to(DEVICE), tables, lens)
    assert_close(out, reference.paged_decode_attention(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE),
                                                       tables, lens))


def test_input_errors_name_the_numbers():
    q, k_cache, v_cache, tables = paged_batch([5, 3], 6, 4, 16, 4)
    tables, lens = padded(tables), torch.tensor([5, 3])
    with pytest.raises(KernelError, match=r"kv_heads=4 does not divide heads=6"):
        ops.paged_decode_attention(q, k_cache, v_cache, tables, lens)
    q = q[:, :4]
    with pytest.raises(KernelError, match=r"block_tables must be \[seqs=2, max_blocks\], got \(3, 2\)"):
        ops.paged_decode_attention(q, k_cache, v_cache, torch.zeros(3, 2, dtype=torch.long), lens)
    with pytest.raises(KernelError, match=r"the cache has head_dim=16, q has 8"):
        ops.paged_decode_attention(q[..., :8], k_cache, v_cache, tables, lens)
    with pytest.raises(KernelError, match=r"block_tables must be int32 or int64, got torch.float32"):
        ops.paged_decode_attention(q, k_cache, v_cache, tables.float(), lens)
    with pytest.raises(KernelError, match=r"must share a float dtype, got torch.bfloat16, torch.float32"):
        ops.paged_decode_attention(q.bfloat16(), k_cache, v_cache, tables, lens)


@pytest.mark.skipif(IN_PROCESS, reason="triton's interpreter is usable in this process")
@pytest.mark.timeout(300)
def test_paged_attention_in_fresh_process():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.basename(__file__)],
                       cwd=os.path.dirname(__file__), env=env, capture_output=True, text=True, timeout=290)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
