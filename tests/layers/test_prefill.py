"""layers.prefill.fresh_prefill: a step of equal-length prompts with nothing cached attends in
one batched call, equal to the general paged path (layers.attention.attend); any other step
is declined (None)."""

import pytest
import torch

from atoll.layers.attention import AttentionMetadata, attend, write_cache
from atoll.layers.prefill import fresh_prefill


def _step(lens, starts, heads=4, kv_heads=2, dim=8, block_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lens)
    q = torch.randn(tokens, heads, dim, generator=g)
    k = torch.randn(tokens, kv_heads, dim, generator=g)
    v = torch.randn(tokens, kv_heads, dim, generator=g)
    per_seq = -(-max(s + n for s, n in zip(starts, lens)) // block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(lens))]
    meta = AttentionMetadata.build(tables, starts, lens, block_size)
    k_cache = torch.randn(len(lens) * per_seq, block_size, kv_heads, dim, generator=g)
    v_cache = torch.randn_like(k_cache)
    write_cache(k_cache, v_cache, k, v, meta)
    return q, k, v, k_cache, v_cache, meta


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("seqs,length", [(1, 7), (3, 5), (4, 2)])
def test_equal_length_fresh_prompts_match_the_paged_path(seqs, length, window):
    q, k, v, k_cache, v_cache, meta = _step([length] * seqs, [0] * seqs)
    fast = fresh_prefill(q, k, v, meta, sliding_window=window)
    assert fast is not None
    torch.testing.assert_close(fast, attend(q, k_cache, v_cache, meta, sliding_window=window),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lens,starts", [([3, 5], [0, 0]), ([2, 2], [0, 4]), ([1, 1], [5, 6]), ([1, 1], [0, 0])])
def test_other_steps_are_declined(lens, starts):
    q, k, v, _, _, meta = _step(lens, starts)
    assert fresh_prefill(q, k, v, meta) is None
