"""Decode attention grouped by context (layers.attention.decode_groups): a step whose rows'
contexts differ widely reads each group's keys up to that group's longest context only, and
gives what one group over every row gives; a step of like contexts stays one group; the
compiled step leaves a grouped step to the eager one."""

import pytest
import torch
import torch.nn.functional as F

from atoll.layers.attention import AttentionMetadata, attend

BLOCK = 4


def _step(lengths: list[int], heads=4, kv_heads=2, dim=8, seed=0):
    """A decode step of sequences with these contexts (new token included), their keys in a
    paged cache of blocks laid one sequence after another; q and a reference per row."""
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-n // BLOCK) for n in lengths)
    k_cache = torch.randn(blocks, BLOCK, kv_heads, dim, generator=g)
    v_cache = torch.randn(blocks, BLOCK, kv_heads, dim, generator=g)
    tables, first = [], 0
    for n in lengths:
        used = -(-n // BLOCK)
        tables.append(list(range(first, first + used)))
        first += used
    q = torch.randn(len(lengths), heads, dim, generator=g)
    meta = AttentionMetadata.build(tables, [n - 1 for n in lengths], [1] * len(lengths), BLOCK)
    expected = []
    for i, n in enumerate(lengths):
        k = k_cache[tables[i]].reshape(-1, kv_heads, dim)[:n].transpose(0, 1)  # [kv_heads, n, dim]
        v = v_cache[tables[i]].reshape(-1, kv_heads, dim)[:n].transpose(0, 1)
        o = F.scaled_dot_product_attention(q[i][:, None], k.repeat_interleave(heads // kv_heads, 0),
                                           v.repeat_interleave(heads // kv_heads, 0))
        expected.append(o[:, 0])
    return q, k_cache, v_cache, meta, torch.stack(expected)


def test_widely_different_contexts_are_grouped_and_give_each_rows_attention():
    lengths = [3, 1030, 7, 5, 9, 2, 260, 4]
    q, k, v, meta, expected = _step(lengths)
    groups = meta.decode_groups(None)
    # by power-of-two block counts, contexts up to 256 keys (64 blocks of 4) together: the six
    # short ones, 260 keys (65 blocks: 128), 1,030 keys (258 blocks: 512)
    assert sorted(tables.shape[1] for _, tables, _ in groups) == [3, 65, 258]
    assert sorted(int(i) for rows, _, _ in groups for i in rows) == list(range(len(lengths)))
    read = sum(len(rows) * tables.shape[1] for rows, tables, _ in groups)
    assert read < 0.3 * len(lengths) * -(-max(lengths) // BLOCK)  # far fewer keys than one group reads
    torch.testing.assert_close(attend(q, k, v, meta), expected, rtol=1e-5, atol=1e-5)


def test_like_contexts_stay_one_group():
    q, k, v, meta, expected = _step([30, 33, 28, 40])
    assert [rows for rows, _, _ in meta.decode_groups(None)] == [None]
    torch.testing.assert_close(attend(q, k, v, meta), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lengths, grouped", [([3, 1030, 7, 5], True), ([30, 33, 28, 40], False)])
def test_the_compiled_step_leaves_grouped_steps_to_the_eager_one(lengths, grouped):
    from types import SimpleNamespace

    from atoll.engine.step.compiled import CompiledDecode

    *_, meta, _ = _step(lengths)
    mb = SimpleNamespace(chunks=[object()] * len(lengths), decode_rows=True, tree=False, tokens=len(lengths), meta=meta)
    step = SimpleNamespace(buckets=[8])
    assert CompiledDecode.takes(step, mb) is (not grouped)


def test_the_plain_rule_the_simulator_asks_gives_the_engines_groups():
    """layers.context_groups (plain Python, what planner/sim asks) splits exactly the steps the
    metadata splits, into the same rows."""
    from atoll.layers.context_groups import context_groups

    rng = torch.Generator().manual_seed(3)
    split = 0
    for _ in range(60):
        n = int(torch.randint(1, 12, (1,), generator=rng))
        top = int(torch.randint(2, 1500, (1,), generator=rng))
        lengths = [int(x) for x in torch.randint(1, top + 1, (n,), generator=rng)]
        *_, meta, _ = _step(lengths)
        groups = context_groups([n - 1 for n in lengths], BLOCK)
        engine = meta.decode_groups(None)
        if groups is None:
            assert [rows for rows, _, _ in engine] == [None], lengths
        else:
            split += 1
            assert sorted(sorted(g) for g in groups) == sorted(sorted(rows.tolist()) for rows, _, _ in engine)
    assert 5 < split < 55  # both kinds of step were drawn
