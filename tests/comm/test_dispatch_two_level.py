"""Two-level dispatch on the ParallelContext's real subgroups: EP4 over 2 islands of 2, the
cross-island leg over the rails and the intra-island leg over each island's group. No
collective of that path touches the whole ep group, it gives flat dispatch's outputs, and its
cross-island bytes are the analytic minimum (comm.routing.min_rows)."""

import functools

import pytest
import torch

from atoll.comm.dispatch import Dispatcher
from atoll.comm.routing import expert_split, min_rows
from atoll.launch.local import run_local
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ContextOptions, ParallelContext, group_ranks

HIDDEN, E = 8, 8
RUNS = [(4, None), (1, None), (2, None), (2, 0.5)]  # (top-k, capacity factor)


def test_grid_makes_islands_and_rails():
    g = group_ranks(Layout.parse("EP4"), (0, 0, 1, 1))
    assert g["ep_island"] == [[0, 1], [2, 3]] and g["ep_rail"] == [[0, 2], [1, 3]]
    g = group_ranks(Layout.parse("TP4EP2"), (0, 0, 1, 1))  # ep groups [0, 2], [1, 3]: one rank per island
    assert g["ep_island"] == [[0], [2], [1], [3]] and g["ep_rail"] == [[0, 2], [1, 3]]
    g = group_ranks(Layout.parse("EP4"), (0, 1, 1, 1))  # unequal islands: no rails
    assert g["ep_island"] == [[0], [1, 2, 3]] and g["ep_rail"] == [[0], [1], [2], [3]]
    assert group_ranks(Layout.parse("EP4"), None)["ep_island"] == [[0, 1, 2, 3]]
    ctx = ParallelContext.detached(Layout.parse("EP4"), 3, options=ContextOptions(islands=(0, 0, 1, 1)))
    assert ctx.ep_islands == [[0, 1], [2, 3]] and ctx.ep_rail.ranks == (1, 3) and ctx.ep_island.ranks == (2, 3)


def _routing(rank, k):
    g = torch.Generator().manual_seed(7 * 100 + rank)
    x = torch.randn(16, HIDDEN, generator=g)
    ids = torch.multinomial(torch.ones(16, E), k, generator=g)
    return x, ids, torch.rand(16, k, generator=g)


def _run(disp, x, ids, w):
    d = disp.dispatch(x, ids, w)
    out = torch.cat([rows * (e + 1) for e, rows in zip(disp.local_experts, d.per_expert())])
    return disp.combine(out, d)


def _worker(rank, world):
    ctx = ParallelContext.create(Layout.parse("EP4"), rank, options=ContextOptions(islands=(0, 0, 1, 1)))
    res = {}
    for k, cf in RUNS:
        x, ids, w = _routing(rank, k)
        flat = Dispatcher(ctx.ep, E, islands=ctx.ep_islands, capacity_factor=cf)
        two = Dispatcher(ctx.ep, E, islands=ctx.ep_islands, capacity_factor=cf, hierarchical=True,
                         island_group=ctx.ep_island, rail_group=ctx.ep_rail)
        for g in ctx.groups.values():
            g.reset_counters()
        y = _run(two, x, ids, w)
        calls = {name: (ctx.groups[name].size, dict(ctx.groups[name].calls)) for name in ("ep", "ep_island", "ep_rail")}
        res[k, cf] = dict(two_level=two.two_level, calls=calls, row_bytes=dict(two.row_bytes), ids=ids.numpy(),
                          y=y.numpy(), flat=_run(flat, x, ids, w).numpy())
    return res


@functools.lru_cache(maxsize=None)
def results():
    return run_local(_worker, 4, timeout_s=110)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("k,cf", RUNS)
def test_two_level_uses_only_subgroups_and_matches_flat(k, cf):
    for rank, r in enumerate(results()):
        got = r[k, cf]
        assert got["two_level"]
        assert got["calls"]["ep"] == (4, {}), f"rank {rank}: a collective spanned the whole ep group"
        for name in ("ep_island", "ep_rail"):
            size, calls = got["calls"][name]
            assert size == 2 and calls.get("all_to_all", 0) > 0, (rank, name, calls)
        if cf is not None:  # the capacity counts come island first, then along the rail
            assert got["calls"]["ep_island"][1]["all_gather"] == got["calls"]["ep_rail"][1]["all_gather"] == 1
        torch.testing.assert_close(torch.from_numpy(got["y"]), torch.from_numpy(got["flat"]), rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("k", [4, 1, 2])
def test_cross_island_bytes_are_the_minimum(k):
    row = HIDDEN * 4
    split = expert_split(E, 4)
    sent = want = 0  # summed over ranks: a relay sends back the rows another rank sent it
    for rank, r in enumerate(results()):
        got = r[k, None]
        want += min_rows(torch.from_numpy(got["ids"]), split, [0, 0, 1, 1], rank)["cross"]
        sent += got["row_bytes"].get("cross", 0)
    assert want > 0 and sent == 2 * row * want  # dispatch out, combine back


def _uneven_worker(rank, world):
    """Islands of 2 + 1 ranks (two nodes, one holding a lone rank), then a group made by its
    members alone, as the expert balancer makes its own: every rank must reach the same one."""
    import torch.distributed as dist

    ctx = ParallelContext.create(Layout.parse("EP3"), rank, options=ContextOptions(islands=(0, 0, 1)))
    group = dist.new_group([0, 1, 2], use_local_synchronization=True)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=group)
    return ctx.ep_island.size, float(t)


@pytest.mark.timeout(90)
def test_uneven_islands_leave_a_group_made_by_its_members_alone_reachable():
    assert run_local(_uneven_worker, 3, timeout_s=60) == [(2, 6.0), (2, 6.0), (1, 6.0)]
