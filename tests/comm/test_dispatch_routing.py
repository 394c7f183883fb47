"""Dispatcher arithmetic without processes: expert placement, reorder index, the capacity rule,
the minimum-bytes count, bad configs, and a whole dispatch/combine at ep=1."""

import math

import pytest
import torch

from atoll.comm.dispatch import Dispatcher
from atoll.comm.group import Group
from atoll.comm.routing import (capacity_keep, capacity_of, check_islands, expert_major,
                                expert_owner, expert_split, min_rows, relay_rank, island_index)
from atoll.errors import ConfigError


def test_expert_split_first_ranks_hold_the_extra():
    assert expert_split(10, 4) == [3, 3, 2, 2]
    assert expert_split(8, 4) == [2, 2, 2, 2]
    assert expert_split(3, 4) == [1, 1, 1, 0]
    ids = torch.arange(10)
    assert expert_owner(ids, [3, 3, 2, 2]).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    assert expert_owner(torch.arange(3), [1, 1, 1, 0]).tolist() == [0, 1, 2]


def test_expert_major_reorders_blocks():
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])  # [source, local expert]
    rows = torch.arange(7)  # arrive as s0:e0 e0 e2 | s1:e0 e1 e1 e1
    idx = expert_major(counts)
    assert rows[idx].tolist() == [0, 1, 3, 4, 5, 6, 2]
    assert expert_major(torch.tensor([[2], [3]])) is None  # one local expert: nothing to do


def test_capacity_keeps_first_pairs_in_rank_token_slot_order():
    ids = [torch.tensor([[0, 1], [0, 2], [1, 0]]), torch.tensor([[0, 1], [2, 0]])]
    counts = torch.stack([torch.bincount(i.reshape(-1), minlength=3) for i in ids])  # [2 ranks, 3]
    assert counts.tolist() == [[3, 2, 1], [2, 1, 1]]
    cap = capacity_of(0.75, 10, 3)
    assert cap == 3  # ceil(0.75 * 10 / 3) = ceil(2.5)
    # expert 0: rank 0 keeps all three, rank 1 none; expert 1: 2 + 1 = 3 all kept
    assert capacity_keep(ids[0], counts, 0, cap).tolist() == [[True, True], [True, True], [True, True]]
    assert capacity_keep(ids[1], counts, 1, cap).tolist() == [[False, True], [True, False]]
    assert capacity_keep(ids[0], counts, 0, 1).tolist() == [[True, True], [False, True], [False, False]]
    assert capacity_of(1.1, 100, 10) == 11  # not 12 from 11.000000000000002


def test_min_rows_counts_one_crossing_per_remote_island():
    # 8 experts on 4 ranks (2 each), islands [[0, 1], [2, 3]]; rank 0 sends
    split, island_of = [2, 2, 2, 2], [0, 0, 1, 1]
    ids = torch.tensor([[0, 1],    # rank 0 only: nothing moves
                        [2, 3],    # rank 1 (same island): one intra hop
                        [4, 6],    # ranks 2 and 3: cross once, then one hop inside
                        [5, 7],    # same
                        [4, -1]])  # rank 2 only; -1 is no expert
    assert min_rows(ids, split, island_of, 0) == {"intra": 3, "cross": 3}


def test_relay_keeps_position_in_island():
    islands = [[0, 1], [2, 3, 4]]
    of = island_index(islands, 5)
    assert [relay_rank(s, islands[1], islands, of) for s in (0, 1)] == [2, 3]
    assert [relay_rank(s, islands[0], islands, of) for s in (2, 3, 4)] == [0, 1, 0]


@pytest.mark.parametrize("kwargs,match", [
    (dict(islands=[[0, 1], [1, 2]]), "do not split"),
    (dict(islands=[[0], [1]], hierarchical=True), "do not split"),  # ep is 1 here
    (dict(hierarchical=True), "needs at least 2 islands"),
    (dict(capacity_factor=0.0), "capacity_factor=0.0"),
])
def test_bad_config_is_one_line(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Dispatcher(Group.single(), 4, **kwargs)
    assert check_islands([[1], [0]], 2) == [[1], [0]]


@pytest.mark.parametrize("cf", [None, 0.5])
def test_single_rank_real_experts(cf):
    """ep=1: dispatch is a local sort, combine the weighted sum; each expert a linear map."""
    g = torch.Generator().manual_seed(0)
    T, H, E, k = 12, 6, 5, 2
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[3, 1] = -1  # no expert for this slot
    w = torch.rand(T, k, generator=g)
    mats = torch.randn(E, H, H, generator=g)
    disp = Dispatcher(Group.single(), E, capacity_factor=cf)
    d = disp.dispatch(x, ids, w)
    assert d.expert_counts == [int((ids == e).sum()) if cf is None else d.expert_counts[e] for e in range(E)]
    y = disp.combine(torch.cat([r @ mats[e].T for e, r in enumerate(d.per_expert())]), d)
    cap = math.inf if cf is None else math.ceil(cf * (T * k - 1) / E)
    seen, ref = [0] * E, torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            if e >= 0:
                if seen[e] < cap:
                    ref[t] += w[t, j] * (mats[e] @ x[t])
                seen[e] += 1
    torch.testing.assert_close(y, ref)
    assert max(d.expert_counts) <= cap
    assert d.dropped == sum(max(0, n - cap) for n in seen if cap < math.inf)
    assert not disp.bytes  # nothing crossed a link
