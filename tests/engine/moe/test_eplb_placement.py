"""comm/eplb.py without processes: the initial placement, DeepSeek's replicate-then-pack
rebalance (global and hierarchical), the relabelling that keeps weights in place, the moves,
and the load report's sum over engines."""

import random

import pytest

from atoll.comm.eplb import LoadReport, Placement, describe, imbalance, moves, pack, rebalance, replicate
from atoll.comm.experts import expert_split
from atoll.errors import ConfigError


def skewed(E=16, hot=range(4), heat=10.0, seed=0):
    """Per-expert loads: `hot` experts heat x the others, with some noise."""
    rng = random.Random(seed)
    return [(heat if e in hot else 1.0) * rng.uniform(90, 110) for e in range(E)]


def rank_imbalance(p: Placement, loads) -> float:
    """max/mean tokens per rank when each copy takes load / copies (the copy choice's aim)."""
    copies = [len(c) for c in p.copies()]
    return imbalance(p.rank_loads([loads[e] / copies[e] for e in p.phy2log]))


def test_initial_is_the_contiguous_split_and_spares_copy_the_first_experts():
    p = Placement.initial(10, 0, 4)
    assert list(p.split) == expert_split(10, 4) and [p.local(r) for r in range(4)] == \
        [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    q = Placement.initial(16, 4, 4)
    assert [q.local(r) for r in range(4)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14],
                                              [15, 0, 1, 2, 3]]
    assert q.copies()[0] == [0, 16] and q.copies()[5] == [5]
    assert q.logical_loads([1] * 20)[:5] == [2, 2, 2, 2, 1]
    with pytest.raises(ConfigError, match="missing"):
        Placement((0, 1, 1), (2, 1), 3)


def test_replicate_gives_spares_to_the_most_load_per_copy():
    # per copy 100, 10, 40 -> 50, 10, 40 -> 33, 10, 40: the third spare goes to the 40
    assert replicate([100, 10, 40], 5) == [3, 1, 1]
    assert replicate([100, 10, 40], 6) == [3, 1, 2]
    assert replicate([5, 5], 2) == [1, 1]


def test_pack_fills_the_lightest_bin_with_room():
    # 10 -> bin 0, 9 -> 1, 8 -> 1 (9 < 10), the 1s -> 0 until it is full, the last -> 1
    assert pack([10, 9, 8, 1, 1, 1], [3, 3]) == [0, 1, 1, 0, 0, 1]
    assert pack([1, 5, 3], [1, 2]) == [1, 0, 1]  # heaviest first, whatever the order given


# (ep, experts, redundant, the balance reached). 10 + 2 over 4: three hot experts of ~980 and
# 2 spare slots leave one hot expert whole, above the ~910 a rank's share: 1.26 is the best
# whole slots give; 10 + 3 slots split unevenly, [4, 3, 3, 3]
@pytest.mark.parametrize("ep,E,R,reached", [(4, 16, 4, 1.1), (8, 64, 8, 1.1), (4, 10, 3, 1.17), (4, 10, 2, 1.26)])
def test_rebalance_brings_a_skewed_load_near_even(ep, E, R, reached):
    loads = skewed(E, hot=range(E // 4, E // 2))
    before = Placement.initial(E, R, ep)
    after = rebalance(loads, before.split, old=before)
    assert after.split == before.split and sorted(set(after.phy2log)) == list(range(E))
    assert rank_imbalance(before, loads) > 1.6
    assert rank_imbalance(after, loads) < reached + 0.01
    hot = [len(c) for c in after.copies()[E // 4:E // 2]]
    assert sum(hot) == len(hot) + R  # every spare slot copies a hot expert


def test_hierarchical_keeps_an_experts_copies_in_one_island():
    islands = [[0, 1], [2, 3]]
    loads = skewed(16, hot={0, 5, 9, 14}, heat=4.0)  # one hot expert in each group of 4
    p = rebalance(loads, (5, 5, 5, 5), groups=4, islands=islands)
    island_of = {r: i for i, isl in enumerate(islands) for r in isl}
    for e, slots in enumerate(p.copies()):
        assert len({island_of[s // 5] for s in slots}) == 1, e
    groups = [{island_of[s // 5] for e in range(g * 4, g * 4 + 4) for s in p.copies()[e]} for g in range(4)]
    assert all(len(g) == 1 for g in groups)  # a whole expert group lies in one island
    assert rank_imbalance(p, loads) < 1.15
    # one group (Qwen3-MoE's router): one global pass, whose copies of one very hot expert
    # spread over both islands
    one_hot = skewed(16, hot={5}, heat=8.0)
    q = rebalance(one_hot, (5, 5, 5, 5), groups=1, islands=islands)
    assert len({island_of[s // 5] for s in q.copies()[5]}) == 2
    assert rank_imbalance(q, one_hot) < 1.15


def test_relabelling_moves_few_weights():
    loads = skewed(16, hot=range(4, 8))
    first = rebalance(loads, (5, 5, 5, 5), old=Placement.initial(16, 4, 4))
    assert rebalance(loads, first.split, old=first) == first  # the same load: nothing moves
    drift = [x * (1.3 if e % 3 == 0 else 1.0) for e, x in enumerate(loads)]
    kept = rebalance(drift, first.split, old=first)
    fresh = rebalance(drift, first.split)
    assert len(moves(first, kept)) < len(moves(first, fresh))


def test_moves_turn_the_old_placement_into_the_new():
    old = Placement.initial(16, 4, 4)
    new = rebalance(skewed(16, hot=range(4, 8)), old.split, old=old)
    weights = [[f"w{e}" for e in old.local(r)] for r in range(4)]  # each slot's weights, named by expert
    after = [list(w) for w in weights]
    plan = moves(old, new, island_of=[0, 0, 1, 1])
    for mv in plan:
        after[mv.dst][mv.dst_slot] = weights[mv.src][mv.src_slot]  # read from the old weights only
    assert after == [[f"w{e}" for e in new.local(r)] for r in range(4)]
    assert all(old.local(mv.src)[mv.src_slot] == new.local(mv.dst)[mv.dst_slot] for mv in plan)
    for mv in plan:  # a holder on the receiver's own island is taken first
        e = new.local(mv.dst)[mv.dst_slot]
        same = [r for r in range(4) if e in old.local(r) and r // 2 == mv.dst // 2]
        assert not same or mv.src in same


def test_reports_add_up_to_the_worst_and_describe_each_layer():
    a = LoadReport(max_mean=1.2, worst_layer=3, window_steps=10, rebalances=1, layers_moved=2,
                   layers={3: {"tokens": [5, 7], "max_mean": 1.2}})
    b = LoadReport(max_mean=2.5, worst_layer=1, window_steps=10, rebalances=0,
                   layers={1: {"tokens": [10, 0], "max_mean": 2.0}})
    assert sum([a, b], 0) == b and 0 + a == a and a + {} == a
    lines = describe(a)
    assert "1.20 at worst (layer 3)" in lines[0] and "layer 3: max/mean 1.20, tokens per EP rank [5, 7]" in lines[1]
    assert describe(None) == [] and imbalance([0, 0]) == 0.0 and imbalance([3, 1]) == 1.5


def test_metrics_give_a_gauge_per_layer_and_the_worst():
    from atoll.serve.metrics import Metrics

    report = LoadReport(max_mean=2.5, worst_layer=1, window_steps=10, rebalances=3,
                        layers={1: {"tokens": [10, 0], "max_mean": 2.5}, 2: {"tokens": [6, 4], "max_mean": 1.2}})
    replicas = {"expert_load": 0 + LoadReport(max_mean=1.1, layers={}) + report}  # as serve/replicas.py adds them
    text = Metrics(lambda: replicas).render()[0].decode()
    assert 'atoll_expert_load_max_mean{layer="1"} 2.5' in text and 'atoll_expert_load_max_mean{layer="2"} 1.2' in text
    assert "atoll_expert_load_max_mean_worst 2.5" in text and "atoll_eplb_rebalances 3.0" in text
    empty = Metrics(lambda: {}).render()[0].decode()
    assert "atoll_expert_load_max_mean_worst 0.0" in empty and "atoll_expert_load_max_mean{" not in empty
