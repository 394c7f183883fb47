"""gather_combine (comm/exchange.py), the MoE layer's fixed-shape exchange: the Dispatcher's
results over real gloo ranks, its bytes, a fullgraph trace, and greedy tokens through
SparseMoE with each exchange forced.
"""

import functools
from collections import Counter

import pytest
import torch
from reference import reference_cache

from atoll.comm.dispatch import Dispatcher
from atoll.comm.exchange import gather_combine
from atoll.comm.group import Group
from atoll.config import resolve
from atoll.errors import ConfigError, InputError
from atoll.kernels import reference
from atoll.launch.local import run_local
from atoll.layers.moe import Experts

HIDDEN, INTER = 16, 8
# (experts, top-k, rows per rank): 6 over 4 ranks splits [2, 2, 1, 1], 5 over 2 [3, 2]
CASES = {2: [(5, 2, 3), (4, 1, 1)], 4: [(6, 2, 3), (3, 2, 2)]}
ISLANDS = {2: [0, 1], 4: [0, 0, 1, 1]}  # island of each ep rank, for the byte classes


def experts_on(rank, world, E, seed=0):
    """This rank's block of E seeded experts (every rank draws the same full set)."""
    g = torch.Generator().manual_seed(seed)
    w13, w2 = torch.randn(E, 2 * INTER, HIDDEN, generator=g) * 0.3, torch.randn(E, HIDDEN, INTER, generator=g) * 0.3
    base, extra = divmod(E, world)
    start = rank * base + min(rank, extra)
    local = range(start, start + base + (rank < extra))
    ex = Experts(local, HIDDEN, INTER, Group.single())
    with torch.no_grad():
        ex.w13.copy_(w13[local.start:local.stop])
        ex.w2.copy_(w2[local.start:local.stop])
    return ex


def routing(seed, rank, rows, E, k):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(rows, HIDDEN, generator=g)
    ids = torch.rand(rows, E, generator=g).topk(k, dim=1).indices
    if rows > 1:
        ids[1, -1] = -1  # a slot routed nowhere
    return x, ids, torch.rand(rows, k, generator=g)


def _suite(rank, world):
    g = Group.from_torch(name="ep")
    out = []
    for ci, (E, k, rows) in enumerate(CASES[world]):
        ex = experts_on(rank, world, E)
        disp = Dispatcher(g, E, grouped=False)
        assert list(disp.local_experts) == list(ex.local)
        for replicated in (False, True):
            x, ids, w = routing(ci, 0 if replicated else rank, rows, E, k)
            d = disp.dispatch(x, ids, w)
            want = disp.combine(ex(d.rows, d.row_experts()), d)
            g.reset_counters()
            counters = Counter()
            got = gather_combine(x, ids, w, ex.weighted, g, disp.split, replicated=replicated,
                                 counters=counters, island_of=ISLANDS[world])
            out.append(dict(case=(E, k, rows, replicated), want=want.numpy(), got=got.numpy(),
                            bytes=dict(counters), calls=dict(g.calls)))
    return out


@functools.lru_cache(maxsize=None)
def suite(ep):
    return run_local(_suite, ep, timeout_s=100)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ep", [2, 4])
def test_gather_combine_equals_dispatch_and_combine(ep):
    for rank, runs in enumerate(suite(ep)):
        for r in runs:
            torch.testing.assert_close(torch.from_numpy(r["got"]), torch.from_numpy(r["want"]),
                                       rtol=1e-5, atol=1e-5, msg=f"rank {rank} case {r['case']}")
            if r["case"][3]:
                assert r["calls"] == {"all_reduce": 1}, r["calls"]
            else:
                assert r["calls"] == {"all_gather": 1, "reduce_scatter": 1}, r["calls"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ep", [2, 4])
def test_gather_combine_bytes(ep):
    """Own rows: to each peer the packed rows (hidden floats, k ids and k weights as float32)
    and back its rows of the partial sums. Replicated: an all_reduce as reduce_scatter then
    all_gather of row chunks, 2 * (ep - 1) * rows rows over all ranks."""
    row = HIDDEN * 4
    for ci, (E, k, rows) in enumerate(CASES[ep]):
        total = 0
        for rank, runs in enumerate(suite(ep)):
            own, rep = runs[2 * ci]["bytes"], runs[2 * ci + 1]["bytes"]
            peers = [j for j in range(ep) if j != rank]
            same = sum(ISLANDS[ep][j] == ISLANDS[ep][rank] for j in peers)
            per_peer = rows * (row + 8 * k) + rows * row
            want = {"intra": same * per_peer, "cross": (len(peers) - same) * per_peer}
            assert own == {c: n for c, n in want.items() if n}, (rank, own)
            total += sum(rep.values())
        assert total == 2 * (ep - 1) * rows * row


@pytest.mark.timeout(120)
def test_static_layer_traces_fullgraph():
    """One rank: SparseMoE in static mode (router, gather_combine, Experts.weighted) compiles
    with fullgraph, one graph for two row counts, and gives the all_to_all path's output."""
    from torch._dynamo.utils import counters

    from atoll.layers.moe import SparseMoE
    from atoll.layers.router import Router
    from atoll.parallel.layout import Layout
    from atoll.parallel.mesh import ParallelContext

    torch._dynamo.reset()
    ctx = ParallelContext.create(Layout.parse("TP1"), 0)
    moe = SparseMoE(hidden=HIDDEN, inter=INTER, router=Router(HIDDEN, 6, 2), ctx=ctx, exchange="alltoall")
    ex = experts_on(0, 1, 6)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(3)))
        moe.experts.w13.copy_(ex.w13)
        moe.experts.w2.copy_(ex.w2)
    step = torch.compile(moe, fullgraph=True, dynamic=False)
    graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for rows in (3, 5):
            x = routing(7, 0, rows, 6, 2)[0]
            moe.static = False
            want = moe(x)  # the Dispatcher
            moe.static, moe.exchange = True, "auto"
            torch._dynamo.mark_dynamic(x, 0, min=2, max=64)
            torch.testing.assert_close(step(x), want, rtol=1e-5, atol=1e-5)
            moe.exchange = "alltoall"
    assert counters["stats"]["unique_graphs"] - graphs == 1
    moe.static = True
    with pytest.raises(ConfigError, match="the compiled decode step needs the MoE gather exchange"):
        moe(x)


def test_gather_combine_skips_other_ranks_experts():
    """Group of one with -1 slots: the per-pair reference, weights applied."""
    ex = experts_on(0, 1, 6)
    x, ids, w = routing(7, 0, 4, 6, 2)
    got = gather_combine(x, ids, w, ex.weighted, Group.single(), [6], replicated=False)
    torch.testing.assert_close(got, reference.fused_moe(x, ex.w13, ex.w2, ids, w), rtol=1e-5, atol=1e-5)


def test_exchange_choice_is_checked():
    with pytest.raises(InputError, match="moe_exchange 'sideways' is not one of auto, alltoall, gather"):
        resolve(environ={"ATOLL_MOE_EXCHANGE": "sideways"})
    assert resolve(environ={"ATOLL_MOE_EXCHANGE": "Gather"}).moe_exchange == "gather"
    assert resolve({"moe_exchange": "alltoall"}, environ={"ATOLL_MOE_EXCHANGE": "gather"}).moe_exchange == "alltoall"
    with pytest.raises(ConfigError, match="ATOLL_MOE_GATHER_ROWS='x' must be a whole number"):
        resolve(environ={"ATOLL_MOE_GATHER_ROWS": "x"})


# --- greedy tokens through the model, each exchange forced ---

PROMPTS = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8]]
NEW = 8
FAMILIES = {"qwen3_moe": ("qwen3_moe", dict(num_experts=5))}  # 5 experts: uneven over 2 ranks


@pytest.fixture(scope="module")
def references(tiny_model):
    return reference_cache(tiny_model, FAMILIES, PROMPTS, NEW)


def _worker(rank, world_size, spec, requests):
    """A one-shot run, recording which exchange each MoE layer used."""
    from atoll.engine.rank.loop import run_batch
    from atoll.engine.rank.runner import ModelRunner
    from atoll.layers.moe import SparseMoE
    from atoll.parallel.layout import Layout
    from atoll.parallel.mesh import ParallelContext

    ctx = ParallelContext.create(Layout.parse(spec.layout), rank)
    runner = ModelRunner(spec, ctx)
    ctx.ep.reset_counters()
    results = run_batch(runner, requests)
    layers = [m for m in runner.model.modules() if isinstance(m, SparseMoE)]
    return dict(results=results if rank == 0 else None, ep_calls=dict(ctx.ep.calls),
                gathered=sum(sum(m.exchange_bytes.values()) for m in layers))


# EP2 is TP2EP2: tokens replicated over ep (dp 1); DP2EP2: each ep rank its own tokens (direct)
@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout", ["EP2", "DP2EP2"])
@pytest.mark.parametrize("exchange", ["gather", "alltoall"])
def test_greedy_tokens_with_each_exchange(references, monkeypatch, layout, exchange):
    """DP2EP2's ranks hold 2 and 1 sequences: the eager gather pads to the larger count."""
    from atoll import LLM, SamplingParams

    model_dir, expected = references("qwen3_moe")
    monkeypatch.setenv("ATOLL_MOE_EXCHANGE", exchange)  # the spawned ranks inherit it
    llm = LLM(model_dir, layout=layout)
    requests = llm.prepare(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    out = run_local(_worker, 2, llm.spec(requests), requests, timeout_s=150)
    assert [r["token_ids"] for r in out[0]["results"]] == expected
    for rank, r in enumerate(out):
        if exchange == "gather":
            assert r["gathered"] > 0 and "all_to_all" not in r["ep_calls"], (rank, r["ep_calls"])
        else:
            assert r["gathered"] == 0 and r["ep_calls"]["all_to_all"] > 0, (rank, r["ep_calls"])
