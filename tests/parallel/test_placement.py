"""Placement: rank -> (node, GPU); TP groups never straddle an island."""

import pytest

from paths import DATA

from atoll.errors import LayoutError
from atoll.parallel.layout import Layout
from atoll.parallel.placement import Placement
from atoll.topologies import load_topology, topology_from_smi


def test_tp8pp2_on_two_nodes_puts_a_stage_on_each_node():
    t = load_topology("dgx-h200", nodes=2)
    p = Placement.build(Layout.parse("TP8PP2"), t)
    assert [p.node_of(r) for r in range(16)] == [0] * 8 + [1] * 8
    assert [p.gpu_of(r) for r in range(16)] == list(range(8)) * 2
    assert p.ranks_on(1) == list(range(8, 16)) and p.ranks_on("node0") == list(range(8))
    assert p.node_name(9) == "node1" and p.nodes == [0, 1]


def test_replicas_take_the_next_gpus():
    t = load_topology("dgx-h100", nodes=2)
    second = Placement.build(Layout(tp=8), t, replica=1)
    assert {second.node_of(r) for r in range(8)} == {1}
    with pytest.raises(LayoutError, match="replica 2 needs GPUs 16..23"):
        Placement.build(Layout(tp=8), t, replica=2)


def test_tp_larger_than_island_refused_unless_allowed():
    t = load_topology("dgx-h100", nodes=2)
    with pytest.raises(LayoutError, match="tp=16 does not fit the 8-GPU NVLink islands"):
        Placement.build(Layout(tp=16), t)
    p = Placement.build(Layout(tp=16), t, allow_cross_island=True)
    assert p.group_span(list(range(16))) == (16, 2, 2)


def test_nvlink_pairs_keep_tp2_on_a_pair():
    text = (DATA / "nvidia-smi-topo/nvlink-pairs-8gpu-a6000.txt").read_text()
    t = topology_from_smi(text)
    p = Placement.build(Layout(tp=2, pp=4), t)
    for start in range(0, 8, 2):
        assert p.island_of(start) == p.island_of(start + 1)
    with pytest.raises(LayoutError, match="straddles a NVLink island"):
        Placement.build(Layout(tp=4, pp=2), t)


def test_pcie_only_box_bounds_tp_by_node():
    t = load_topology("l40s-pcie", nodes=2)
    assert Placement.build(Layout(tp=8, pp=2), t).node_of(8) == 1
    with pytest.raises(LayoutError, match="8-GPU nodes"):
        Placement.build(Layout(tp=16), t)


def test_to_dict_is_plain():
    p = Placement.build(Layout(tp=2), load_topology("dgx-h100"))
    assert p.to_dict()["ranks"][1] == {"rank": 1, "node": "node0", "node_index": 0, "gpu": 1, "island": 0}
