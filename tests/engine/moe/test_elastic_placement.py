"""comm/elastic.py without processes: the placement an ep group keeps after losing a rank,
orphaned experts loaded from the checkpoint into spare slots (or new ones), and the one-line
error for an expert with no source."""

import random

import pytest

from atoll.comm.elastic import survive, survive_layers, survivors_of
from atoll.comm.eplb import Placement, rebalance
from atoll.errors import ConfigError, ExpertLost


def every(e):
    return True


def check_survival(old: Placement, lost: set, s):
    """What every survival must hold: each expert kept, survivors' other slots untouched, and
    each load names a slot that holds its expert and whose expert had no copy left."""
    new = s.placement
    assert sorted(set(new.phy2log)) == list(range(old.num_logical))
    assert s.survivors == tuple(r for r in range(old.ep) if r not in lost)
    loaded = {(x.rank, x.slot): x.expert for x in s.loads}
    for i, r in enumerate(s.survivors):
        before, after = old.local(r), new.local(i)
        for j, e in enumerate(after):
            if (i, j) in loaded:
                assert e == loaded[(i, j)]
            else:
                assert j < len(before) and before[j] == e  # kept in place: nothing moved
    left = {e for r in s.survivors for e in old.local(r)}
    assert sorted(x.expert for x in s.loads) == sorted(set(range(old.num_logical)) - left)


def test_copies_left_on_survivors_need_no_load():
    # 8 experts + 4 spares over EP4: every expert of rank 1 (3, 4, 5) has a copy elsewhere
    old = Placement((0, 1, 2, 3, 4, 5, 6, 7, 3, 4, 5, 7), (3, 3, 3, 3), 8)
    s = survive(old, {1})
    assert s.loads == () and s.survivors == (0, 2, 3)
    assert [s.placement.local(i) for i in range(3)] == [[0, 1, 2], [6, 7, 3], [4, 5, 7]]
    check_survival(old, {1}, s)


def test_an_orphan_takes_a_spare_slot_of_the_expert_with_most_copies():
    # rank 1 held 3, 4, 5 alone; survivors hold 0 three times, 1 twice
    old = Placement((0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 1, 7), (3, 3, 3, 3), 8)
    s = survive(old, {1}, every)
    check_survival(old, {1}, s)
    assert sorted(x.expert for x in s.loads) == [3, 4, 5]
    # three orphans took three of the four spare copies (0 twice and 1, or 7): one copy of each is left
    assert sorted(len(c) for c in s.placement.copies()) == [1] * 7 + [2]
    assert s.placement.num_slots == 9 and list(s.placement.split) == [3, 3, 3]
    # the first orphan took one of expert 0's three copies
    first = s.loads[0]
    assert old.local(s.survivors[first.rank])[first.slot] == 0


def test_without_spares_an_orphan_gets_a_new_slot_on_the_smallest_survivor():
    old = Placement.initial(10, 0, 4)  # [0,1,2] [3,4,5] [6,7] [8,9]
    s = survive(old, {1}, every)
    check_survival(old, {1}, s)
    assert [s.placement.local(i) for i in range(3)] == [[0, 1, 2, 5], [6, 7, 3], [8, 9, 4]]
    assert list(s.placement.split) == [4, 3, 3]


def test_random_placements_and_losses_keep_every_expert():
    rng = random.Random(0)
    for _ in range(200):
        ep = rng.randint(2, 6)
        E = rng.randint(ep, 24)
        R = rng.randint(0, 2 * ep)
        loads = [rng.uniform(1, 100) for _ in range(E)]
        split = [(E + R) // ep + (r < (E + R) % ep) for r in range(ep)]
        old = rebalance(loads, split)
        lost = set(rng.sample(range(ep), rng.randint(1, ep - 1)))
        check_survival(old, lost, survive(old, lost, every))


def test_an_expert_with_no_source_fails_with_one_line_naming_it():
    old = Placement.initial(8, 0, 4)  # rank 2 holds experts 4 and 5 alone
    with pytest.raises(ExpertLost) as err:
        survive(old, {2}, layer=3)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("expert 4 of MoE layer 3 has no source") and "[2]" in msg
    # the checkpoint can load 4 but not 5: 5 is named
    with pytest.raises(ExpertLost, match="^expert 5 of MoE layer 3"):
        survive(old, {2}, lambda e: e == 4, layer=3)


def test_layers_name_the_layer_whose_expert_is_lost():
    copied = Placement((0, 1, 2, 3, 0, 1, 2, 3), (2, 2, 2, 2), 4)
    alone = Placement((0, 1, 2, 3, 4, 5, 6, 7), (2, 2, 2, 2), 8)
    out = survive_layers({1: copied, 5: copied}, {0})
    assert set(out) == {1, 5} and out[1].loads == ()
    with pytest.raises(ExpertLost, match="^expert 2 of MoE layer 7 "):
        survive_layers({1: copied, 7: alone}, {1}, lambda layer, e: layer != 7)


def test_survivors_of_checks_the_lost_ranks():
    assert survivors_of(4, [3]) == (0, 1, 2)
    with pytest.raises(ConfigError, match="lost ep ranks"):
        survivors_of(4, [4])
    with pytest.raises(ConfigError, match="nothing survives"):
        survivors_of(2, [0, 1])
