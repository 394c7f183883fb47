"""Dispatcher over real gloo ranks: the combine invariant, sender-identifying rows, real expert
maps against a one-process reference, and cross-island bytes of the hierarchical path.

Every rank's routing is drawn from a seed, so any process can recompute all ranks' routing;
the expectations below are computed with plain loops, independently of comm/routing.py.
"""

import functools
import math

import pytest
import torch

from atoll.comm.dispatch import Dispatcher
from atoll.comm.group import Group
from atoll.launch.local import run_local

HIDDEN = 8

# tokens per rank (zeros included), experts that do and do not divide ep, skewed routing so
# that capacity really drops pairs
CASES = {
    2: [dict(E=4, k=2, tokens=[6, 0]),
        dict(E=5, k=3, tokens=[0, 9], skew=True),
        dict(E=1, k=1, tokens=[3, 4]),  # rank 1 holds no expert
        dict(E=7, k=2, tokens=[11, 5], skew=True)],
    4: [dict(E=8, k=2, tokens=[5, 0, 7, 3]),
        dict(E=10, k=3, tokens=[4, 6, 0, 0], skew=True),
        dict(E=3, k=2, tokens=[2, 3, 4, 5]),  # rank 3 holds no expert
        dict(E=16, k=4, tokens=[12, 1, 0, 9], skew=True)],
}
ISLANDS = {2: [[[0], [1]]], 4: [[[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0], [1, 2, 3]]]}
CAPACITY = [None, 0.5]


def routing(seed, rank, tokens, E, k, skew=False, coded=False):
    """x: [tokens, HIDDEN]; with coded, row t of rank r is r*1000 + t + column/64."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    if coded:
        x = rank * 1000.0 + torch.arange(tokens, dtype=torch.float32)[:, None] \
            + torch.arange(HIDDEN, dtype=torch.float32) / 64
    else:
        x = torch.randn(tokens, HIDDEN, generator=g)
    probs = (E - torch.arange(E, dtype=torch.float32)) ** 2 if skew else torch.ones(E)
    ids = torch.multinomial(probs.repeat(tokens, 1), k, generator=g) if tokens else \
        torch.empty(0, k, dtype=torch.long)
    return x, ids, torch.rand(tokens, k, generator=g)


def owner(e, E, ep):
    """The documented placement: contiguous blocks, the first E % ep ranks hold one more."""
    start = 0
    for r in range(ep):
        n = E // ep + (r < E % ep)
        if e < start + n:
            return r
        start += n
    raise AssertionError(e)


def kept_pairs(ids_by_rank, E, cf):
    """{(src, t, j): kept}: each expert keeps its first capacity pairs in (src, t, j) order."""
    total = sum(ids.numel() for ids in ids_by_rank)
    cap = math.inf if cf is None else math.ceil(cf * total / E)
    seen = [0] * E
    kept = {}
    for src, ids in enumerate(ids_by_rank):
        for t, row in enumerate(ids.tolist()):
            for j, e in enumerate(row):
                kept[src, t, j] = seen[e] < cap
                seen[e] += 1
    return kept


def _check_cases(rank, world, g):
    """Run every case on this rank; returns (failures, (pairs dropped, experts that received
    nothing), cases checked)."""
    failures, n_dropped, n_checked = [], [0, 0], 0
    for ci, case in enumerate(CASES[world]):
        E, k, tokens = case["E"], case["k"], case["tokens"]
        skew = case.get("skew", False)
        every = [routing(ci, r, tokens[r], E, k, skew, coded=True) for r in range(world)]
        for cf in CAPACITY:
            kept = kept_pairs([e[1] for e in every], E, cf)
            # flat reads islands only for its byte counters: one layout is enough there
            first = ISLANDS[world][0]
            runs = [(False, first, True), (False, first, False), (True, first, False)] \
                + [(True, i, True) for i in ISLANDS[world]]
            for hier, islands, grouped in runs:
                what = (f"rank {rank} case {ci} {case} capacity={cf} hierarchical={hier} "
                        f"islands={islands} grouped={grouped}")
                try:
                    d = _check_one(rank, world, g, every, kept, E, k, tokens, cf, hier, islands, grouped)
                    n_dropped[0] += d.dropped
                    n_dropped[1] += d.expert_counts.count(0)
                except AssertionError as e:
                    failures.append(f"{what}: {e}")
                n_checked += 1
    return failures, n_dropped, n_checked


def _check_one(rank, world, g, every, kept, E, k, tokens, cf, hier, islands, grouped):
    x, ids, w = every[rank]
    disp = Dispatcher(g, E, islands=islands, capacity_factor=cf, hierarchical=hier, grouped=grouped)
    d = disp.dispatch(x, ids, w)
    # sender-identifying: every received row is exactly the row some kept pair sent
    mine = [e for e in range(E) if owner(e, E, world) == rank]
    assert list(disp.local_experts) == mine, f"local experts {list(disp.local_experts)}"
    assert d.expert_counts == [len(r) for r in d.per_expert()]
    which = d.row_experts()
    assert which.shape == (d.rows.shape[0],)
    for i, rows in enumerate(d.per_expert()):
        assert torch.equal(d.rows[which == i], rows), f"row_experts disagrees for local expert {i}"
    if not grouped and not hier:  # arrival order: source rank, then local expert, then token
        assert torch.equal(d.rows[:, 0].floor() // 1000, torch.sort(d.rows[:, 0].floor() // 1000).values)
    for e, got in zip(mine, d.per_expert()):
        want = [every[s][0][t] for s in range(world) for t in range(tokens[s])
                for j in range(k) if every[s][1][t, j] == e and kept[s, t, j]]
        want = torch.stack(want) if want else torch.empty(0, HIDDEN)
        if hier:  # the order is by relay there; compare as sets of rows
            got, want = got[got[:, 0].argsort()], want[want[:, 0].argsort()]
        assert torch.equal(got, want), f"expert {e} got {got[:, 0].tolist()} want {want[:, 0].tolist()}"
    # the invariant: identity experts give x * (sum of the kept weights)
    y = disp.combine(d.rows.clone(), d)
    keep = torch.tensor([[kept[rank, t, j] for j in range(k)] for t in range(tokens[rank])],
                        dtype=torch.bool).view(tokens[rank], k)
    assert y.shape == x.shape
    torch.testing.assert_close(y, x * (w * keep).sum(1, keepdim=True), rtol=1e-6, atol=1e-4)
    assert d.dropped == int((~keep).sum()), f"dropped {d.dropped}"
    return d


EXPERT_RUNS = {2: [(None, False, True), (0.5, True, True), (None, False, False)],
               4: [(None, False, True), (None, True, True), (0.5, False, True), (0.5, True, True),
                   (0.5, True, False)]}
REAL_E, REAL_TOKENS = 6, [7, 0, 10, 4]


def expert_weights():
    return torch.randn(REAL_E, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(5))


def _real_experts(rank, world, g, cf, hier, grouped):
    """Each expert a different linear map; returns this rank's x, ids, w and combined output."""
    islands = [[0, 1], [2, 3]] if world == 4 else [[0], [1]]
    disp = Dispatcher(g, REAL_E, islands=islands, capacity_factor=cf, hierarchical=hier, grouped=grouped)
    x, ids, w = routing(9, rank, REAL_TOKENS[rank], REAL_E, 2, skew=True)
    d = disp.dispatch(x, ids, w)
    weights = expert_weights()
    if grouped:
        outs = [rows @ weights[e].T for e, rows in zip(disp.local_experts, d.per_expert())]
        y = disp.combine(torch.cat(outs) if outs else d.rows.clone(), d)
    else:  # arrival order: each row through its own expert, written in place
        which, out = d.row_experts(), torch.empty_like(d.rows)
        for i, e in enumerate(disp.local_experts):
            out[which == i] = d.rows[which == i] @ weights[e].T
        y = disp.combine(out, d)
    return [t.numpy() for t in (x, ids, w, y)]  # tensors would travel as shared-memory fds


def _bytes(rank, world, g, k):
    """Flat and hierarchical on the same routing: their row bytes per link class and outputs."""
    x, ids, w = routing(3, rank, 16, 8, k)
    res = {}
    for hier in (False, True):
        disp = Dispatcher(g, 8, islands=[[0, 1], [2, 3]], hierarchical=hier)
        d = disp.dispatch(x, ids, w)
        y = disp.combine(d.rows.clone(), d)
        res[hier] = (dict(disp.row_bytes), y.numpy())
    return ids.numpy(), res


def _suite(rank, world):
    """Everything for one ep size in one spawn (a spawn costs seconds)."""
    g = Group.from_torch(name="ep")
    out = {"cases": _check_cases(rank, world, g),
           "real": {run: _real_experts(rank, world, g, *run) for run in EXPERT_RUNS[world]}}
    if world == 4:
        out["bytes"] = {k: _bytes(rank, world, g, k) for k in (4, 1)}
    return out


@functools.lru_cache(maxsize=None)
def suite(ep):
    return run_local(_suite, ep, timeout_s=110)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ep", [2, 4])
def test_invariant_and_senders(ep):
    out = [r["cases"] for r in suite(ep)]
    failures = [f for fails, _, _ in out for f in fails]
    assert not failures, "\n".join(failures[:10])
    assert out[0][2] == len(CASES[ep]) * len(CAPACITY) * (3 + len(ISLANDS[ep]))
    assert sum(n[0] for _, n, _ in out) > 0  # the capacity cases really dropped pairs
    assert sum(n[1] for _, n, _ in out) > 0  # and some experts received no rows


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ep", [2, 4])
def test_real_experts_match_one_process(ep):
    weights = expert_weights()
    for cf, hier, grouped in EXPERT_RUNS[ep]:
        out = [[torch.from_numpy(a) for a in r["real"][cf, hier, grouped]] for r in suite(ep)]
        kept = kept_pairs([o[1] for o in out], REAL_E, cf)
        for src, (x, ids, w, y) in enumerate(out):
            ref = torch.zeros_like(x)  # one process, token by token
            for t in range(x.shape[0]):
                for j in range(ids.shape[1]):
                    if kept[src, t, j]:
                        ref[t] += w[t, j] * (weights[ids[t, j]] @ x[t])
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5,
                                       msg=f"rank {src} capacity={cf} hierarchical={hier} grouped={grouped}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("k", [4, 1])
def test_hierarchical_crosses_once_per_island(k):
    row = HIDDEN * 4
    island = lambda e: owner(e, 8, 4) // 2  # noqa: E731  islands [[0, 1], [2, 3]]
    flat = hier = want_flat = want_hier = 0
    for src, r in enumerate(suite(4)):
        ids, res = r["bytes"][k]
        torch.testing.assert_close(torch.from_numpy(res[True][1]), torch.from_numpy(res[False][1]))
        # rows leaving src's island: one per (token, remote expert) pair, or per (token, remote island)
        pairs = [(t, island(e)) for t, es in enumerate(ids.tolist()) for e in es if island(e) != src // 2]
        want_flat += len(pairs)
        want_hier += len(set(pairs))
        flat += res[False][0].get("cross", 0)
        hier += res[True][0].get("cross", 0)
    assert flat == 2 * row * want_flat  # dispatch out and combine back
    assert hier == 2 * row * want_hier
    if k == 4:  # 4 of 8 experts: nearly every token picks several experts on the remote island
        assert hier < flat
    else:  # one expert per token: nothing to share, the same bytes cross
        assert hier == flat
