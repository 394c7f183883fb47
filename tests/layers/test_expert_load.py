"""The MoE layer's load counter and copy routing (layers/expert_map.py) in one process: each
copy taken in turn, padding rows and rows not kept left out, the same output whichever
copies hold the experts, and one compiled graph for every layer and step with the counter
inside it."""

import pytest
import torch
from torch._dynamo.utils import counters

from atoll.comm.eplb import Placement
from atoll.config import EngineConfig
from atoll.layers.expert_map import ExpertLoad, ExpertMap
from atoll.layers.moe import SparseMoE
from atoll.layers.router import Router
from atoll.parallel.mesh import ParallelContext

H, INTER, E, K = 16, 8, 6, 2


def test_route_takes_an_experts_copies_in_turn():
    # expert 0 in slots 0, 6, 7; the others in one slot each
    p = Placement((0, 1, 2, 3, 4, 5, 0, 0), (8,), 6)
    m = ExpertMap(p)
    ids = torch.tensor([[0, 1], [2, 0], [0, 3], [0, 4]])
    slots = m.route(ids)
    assert [[p.phy2log[s] for s in row] for row in slots.tolist()] == ids.tolist()  # the same experts
    # pair positions 0, 3, 4, 6 (row * k + slot): copies (0, 3, 4, 6) mod 3 -> 0, 0, 1, 0
    assert [slots[0, 0], slots[1, 1], slots[2, 0], slots[3, 0]] == [0, 0, 6, 0]
    shifted = m.route(ids, first=1)  # the same rows one later among the group's: 2, 5, 6, 8 -> 2, 2, 0, 2
    assert [shifted[0, 0], shifted[1, 1], shifted[2, 0], shifted[3, 0]] == [7, 7, 0, 7]
    many = m.route(torch.zeros(30, 1, dtype=torch.long))
    assert torch.bincount(many[:, 0], minlength=8)[[0, 6, 7]].tolist() == [10, 10, 10]
    m.set(Placement.initial(6, 2, 1))  # in place: 0 and 1 doubled now
    assert m.copies.tolist() == [2, 2, 1, 1, 1, 1] and m.table[1, :2].tolist() == [1, 7]


def test_count_keeps_only_the_rows_kept():
    load = ExpertLoad(4)
    load.count(torch.tensor([[0, 1], [1, -1], [3, 2]]), keep=torch.tensor([True, True, False]))
    load.count(torch.tensor([[2, 2]]))
    assert load.counts.tolist() == [1, 2, 2, 0]


def moe(redundant: int, seed: int = 0) -> SparseMoE:
    """A one-rank SparseMoE of E seeded experts; with EPLB its slots are filled from them by
    the experts' own loader, as a checkpoint would."""
    ctx = ParallelContext.single()
    engine = EngineConfig(enable_eplb=bool(redundant), num_redundant_experts=redundant)
    layer = SparseMoE(hidden=H, inter=INTER, router=Router(H, E, K), ctx=ctx, engine=engine)
    g = torch.Generator().manual_seed(seed)
    w13, w2 = torch.randn(E, 2 * INTER, H, generator=g) * 0.3, torch.randn(E, H, INTER, generator=g) * 0.3
    with torch.no_grad():
        layer.gate.weight.copy_(torch.randn(E, H, generator=g))
        for e in range(E):
            for part in (0, 1):
                layer.experts.w13.weight_loader(layer.experts.w13, w13[e, part * INTER:(part + 1) * INTER], (e, part))
            layer.experts.w2.weight_loader(layer.experts.w2, w2[e], (e, "down"))
    return layer


def test_copies_give_the_same_output_and_padding_is_not_counted():
    plain, eplb = moe(0), moe(3)
    assert eplb.placement.num_slots == E + 3 and eplb.experts.logical == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = plain(x)
        assert torch.allclose(eplb(x), y, atol=1e-6)
        pairs = eplb.expert_load.counts.clone()
        assert int(pairs.sum()) == 7 * K and int(pairs[6:].sum()) > 0  # some pairs went to the copies
        assert eplb.placement.logical_loads(pairs.tolist()) == plain.expert_load.counts.tolist()
        real = torch.tensor([True] * 5 + [False] * 2)  # a bucket of 7 rows, 2 of them padding
        with eplb.static_exchange(real=real):
            assert torch.allclose(eplb(x), y, atol=1e-6)
    assert int(eplb.expert_load.counts.sum() - pairs.sum()) == 5 * K


@pytest.mark.timeout(300)
def test_the_counter_runs_inside_one_compiled_graph_for_every_layer_and_step():
    """Compiled as the CPU step compiles a decoder layer kind (engine/step/compiled.py): the
    unbound forward, rows symbolic; two layers and three steps of other row counts and other
    padding run one graph, and count as the eager layers do."""
    torch._dynamo.reset()
    layers, eager = [moe(3, seed=1), moe(3, seed=2)], [moe(3, seed=1), moe(3, seed=2)]
    forward = torch.compile(SparseMoE.forward, fullgraph=True, dynamic=False)
    before = counters["stats"]["unique_graphs"]
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for rows, real_rows in ((4, 3), (6, 6), (8, 5)):
            x = torch.randn(rows, H, generator=gen)
            real = torch.arange(rows) < real_rows
            torch._dynamo.mark_dynamic(x, 0, min=2, max=1 << 16)
            torch._dynamo.mark_dynamic(real, 0, min=2, max=1 << 16)
            for layer, ref in zip(layers, eager):
                with layer.static_exchange(real=real), ref.static_exchange(real=real):
                    assert torch.allclose(forward(layer, x), ref(x), atol=1e-5)
    assert counters["stats"]["unique_graphs"] - before == 1
    for layer, ref in zip(layers, eager):
        assert layer.expert_load.counts.tolist() == ref.expert_load.counts.tolist()
        assert int(layer.expert_load.counts.sum()) == (3 + 6 + 5) * K
