"""One MoE layer's cost in a decode or prefill pass, as the runtime runs it (layers/moe.py,
comm/dispatch.py, comm/exchange.py): the busiest EP rank's expert reads and GEMMs, the shared
expert, and the exchange that brings tokens to their experts and back.

EP and expert TP (moe_tp) split the same work differently, and cost differently:
- EP (ep > 1): whole experts on fewer ranks. Each token's copies go to the ranks holding its
  selected experts (an all-to-all, or at decode sizes inside one island a gather); routing is
  skewed, so the busiest rank gets more (token, expert) pairs than the mean: more GEMM rows and
  more bytes to receive, and every rank waits for it at the combine.
- moe_tp: every expert's intermediate dim split over moe_tp ranks. Each rank reads 1/moe_tp of
  every active expert and runs every pair routed to it, so the work is balanced (no
  imbalance), but the outputs are partial sums that an all_reduce over moe_tp adds up.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from atoll.planner.workload import gather_max_rows  # the runtime's threshold (the config's moe_gather_rows)
from atoll.planner.categories import EXPERTS, WEIGHTS
from atoll.planner.collectives import all_gather, all_reduce, all_to_all, island_first_all_to_all
from atoll.errors import ConfigError
from atoll.planner import expert_balance
# the sourced expert imbalance (efficiency.py), which the gate model is fitted to
from atoll.planner.efficiency import EXPERT_IMBALANCE  # noqa: F401  (re-exported for the tests)
from atoll.planner.parts import is_many, vall, vany, vceil, vmax, vmin, vnot, vpow, vwhere


def expected_busiest_experts(tokens, experts: int, top_k: int, ranks: int):
    """Expected number of distinct experts the busiest EP rank runs for `tokens` tokens, under
    uniform top-k routing: each rank's count is Binomial(local, p), p = 1-(1-k/E)^tokens,
    local = ceil(E/ranks) as the runtime splits them (comm.routing.expert_split: the busiest
    rank holds the extra one), and E[max of `ranks` draws] = sum_x (1 - F(x)^ranks).
    `tokens` may be an array: the same for each."""
    return _expected_busiest(tokens, 1.0 - vpow(1.0 - top_k / experts, tokens), experts, top_k, ranks)


def _expected_busiest(tokens, p, experts: int, top_k: int, ranks: int):
    """expected_busiest_experts given p; each token count's sum is remembered: the search
    asks for the same counts on every layout."""
    local = -(-experts // ranks)
    if not is_many(tokens):
        return local * p if ranks == 1 or p >= 1.0 else _busiest(tokens, experts, top_k, ranks)
    out = local * p
    if ranks > 1:
        few = p < 1.0
        if few.any():
            some, back = np.unique(tokens[few], return_inverse=True)
            out[few] = np.array([_busiest(t, experts, top_k, ranks) for t in some.tolist()])[back]
    return out


@functools.lru_cache(maxsize=1 << 16)
def _busiest(tokens: float, experts: int, top_k: int, ranks: int) -> float:
    local = -(-experts // ranks)
    p = 1.0 - (1.0 - top_k / experts) ** tokens
    if ranks == 1 or p >= 1.0:
        return local * p
    cdf, total, pmf = 0.0, 0.0, (1 - p) ** local
    for x in range(local):
        cdf += pmf
        total += 1.0 - min(cdf, 1.0) ** ranks
        pmf *= (local - x) / (x + 1) * p / (1 - p)
    return total


def expert_imbalance(workload, shapes, ep: int) -> float:
    """Pairs on the busiest EP rank over the mean at large batches; 1.0 without EP (every rank
    holds a slice of every expert). The workload's expert_imbalance where given, else derived
    from the gate's statistics and the placement (planner/expert_balance.py): a recorded load
    file's (workload.expert_loads) or the gate model's, with EPLB's placement and the
    workload's redundant slots when it has eplb on, the contiguous blocks when not."""
    if ep <= 1 or not shapes.experts:
        return 1.0
    k, local = shapes.top_k, shapes.experts_per_rank(ep)
    f = workload.expert_imbalance
    if f is None:
        f = balance_of(shapes.experts, k, ep, workload.redundant_experts, workload.eplb, workload.expert_loads)
    # no rank gets more than every token's pairs with its experts: min(k, local) per token
    return min(f, ep * min(k, local) / k)


def balance_of(experts: int, top_k: int, ep: int, redundant: int, eplb: bool, loads) -> float:
    """expert_balance's figure: from recorded loads where there are, else the gate model."""
    if loads is None:
        return expert_balance.modelled(experts, top_k, ep, redundant, eplb)
    if len(loads[0]) != experts:
        raise ConfigError(f"the expert load file counts {len(loads[0])} experts a layer; the model has {experts}")
    return _from_loads(loads, ep, redundant, eplb)


@functools.lru_cache(maxsize=256)
def _from_loads(loads, ep: int, redundant: int, eplb: bool) -> float:
    return expert_balance.from_loads(loads, ep, redundant, eplb)


def busiest_pairs(workload, shapes, tokens, ep: int) -> tuple[float, float]:
    """(pairs, distinct experts) of the busiest EP rank for `tokens` tokens over the stage.

    Two sources of skew, combined by max, not by product, so neither is counted twice: at tiny
    batches the luck of the draw under uniform routing (expected_busiest_experts: the busiest
    rank's distinct experts, each with tokens*k/(E*p) pairs, about one pair each at batch 1,
    already several times the mean), at large batches the measured imbalance, whose figure
    already holds the draw at its own batch (1024 pairs per rank). Skewed routing puts tokens
    on fewer, hotter experts: it raises the busiest rank's pairs (GEMM rows, bytes received),
    not its distinct experts (its weight reads, at most its `local` experts)."""
    E, k = shapes.experts, shapes.top_k
    local = shapes.experts_per_rank(ep)
    p = 1.0 - vpow(1.0 - k / E, tokens)
    distinct = _expected_busiest(tokens, p, E, k, ep)
    drawn = distinct * tokens * k / (E * p)
    # mean pairs of a rank with `local` experts (the runtime's first ranks hold one more)
    skewed = tokens * k * local / E * expert_imbalance(workload, shapes, ep)
    return vmin(vmax(drawn, skewed), tokens * min(k, local)), distinct


def sub_links(stage, size: int, stride: int):
    """Links of a group of `size` ranks of the stage `stride` apart (the moe_tp group is
    consecutive ranks, the ep group steps over them: parallel.mesh's [ep, moe_tp] grid, the
    dp group steps over tp), from the stage's. Concurrent groups share the links as the
    stage's do. Islands are taken to be nodes, as in the presets."""
    per = min(size, max(1, stage.per_island // stride))
    islands = -(-size // per)
    return dataclasses.replace(stage, size=size, per_island=per, islands=islands,
                               cross_kind=stage.cross_kind if islands > 1 else "")


def moe_layer(cm, out, *, n, n_all, act, wb: int, prefill: bool = False):
    """Adds one MoE layer's expert reads, shared expert and exchange to `out` (seconds by
    category). n: tokens on one DP rank; n_all: tokens entering the layer over the stage
    (numbers, or arrays of them: parts.py). Returns the seconds of its ep exchange, which
    two-batch overlap can hide (planner/two_batch.py)."""
    s, l, w = cm.s, cm.l, cm.w
    ep, mt, k = l.ep, l.moe_tp, s.top_k
    # routed experts on the busiest EP rank: its distinct experts, each 1/moe_tp of its weights,
    # and its pairs (skewed; with ep == 1 every rank runs its slice of every pair: balanced)
    pairs, distinct = busiest_pairs(w, s, n_all, ep)
    per_expert = s.expert / mt
    cm._op(out, distinct * per_expert * wb, 2 * pairs * per_expert, EXPERTS, rows=pairs / vmax(distinct, 1.0))
    shared = s.shared_expert / l.tp
    if shared:
        cm._op(out, shared * wb + s.router * 2, 2 * n * shared, WEIGHTS)

    row = s.hidden * w.act_bytes
    g_ep, g_mt = cm.links(ep, mt), cm.links(mt, 1)
    direct = l.tp == mt  # ep rank e is DP group e: its own tokens are its share (layers/moe.py)
    rows = n if direct else n_all  # tokens an ep rank's group routes
    if not direct and l.dp > 1:  # DP attention under split experts: the stage's tokens first
        g_dp = cm.links(l.dp, l.tp)
        out.add(cm._comm_name("MoE all-gather", g_dp), all_gather(n_all * row, g_dp))
    reduced = rows  # rows of moe_tp partial sums each rank ends with
    moved = 0.0  # seconds of the ep exchange, which two-batch overlap can hide
    if ep > 1:
        per_rank = rows if direct else vceil(rows / ep)
        # comm.exchange.gather_combine at decode sizes inside one island: fixed shapes, no
        # counts; rows meet every ep rank. Else the all-to-all dispatch and combine.
        gather = g_ep.islands == 1 and per_rank <= gather_max_rows()
        if vany(gather):
            t = (all_gather(ep * per_rank * (row + 8 * k), g_ep) + all_gather(ep * per_rank * row, g_ep)
                 if direct else all_reduce(rows * row, g_ep))  # reduce_scatter moves an all_gather's bytes
            out.add(cm._comm_name("MoE gather", g_ep), t, when=gather)
            moved = vwhere(gather, t, 0.0)
        if not vall(gather):
            t = (_pairs_over_rdma(cm, g_ep, per_rank, pairs) if cm.w.low_latency_decode and not prefill
                 else _dispatch_combine(cm, g_ep, per_rank, n_all, pairs))
            out.add(cm._comm_name("all-to-all", g_ep), t, when=vnot(gather))
            if not direct:  # each ep rank routed a chunk of the stage's tokens: gathered back
                back = all_gather(rows * row, g_ep)
                out.add(cm._comm_name("MoE all-gather", g_ep), back, when=vnot(gather))
                t = t + back
            moved = moved + vwhere(gather, 0.0, t)
            reduced = vwhere(gather, rows, per_rank)
    if mt > 1:  # moe_tp partial sums, added over the moe_tp group
        name = cm._comm_name("TP all-reduce" if mt == l.tp else "MoE all-reduce", g_mt)
        out.add(name, all_reduce(reduced * row, g_mt))
    return moved


def _dispatch_combine(cm, g, per_rank, n_all, pairs):
    """Seconds of the Dispatcher's dispatch and combine when each rank routes `per_rank`
    tokens, the ep group routes `n_all` and the busiest rank receives `pairs` of them.

    One copy per (token, expert) pair, as the runtime's flat dispatch moves rows; fp8 rows
    when the weights are fp8 (DeepEP's dispatch), the combine in the activations' dtype. An
    all-to-all lasts until its busiest rank has sent and received its bytes: the most a rank
    sends (per_rank x k pairs) or the busiest rank's receipts, whichever is larger.

    Across islands the runtime dispatches island first (comm/dispatch.py, as DeepEP's
    internode kernels do): a token crosses once to each remote island holding any of its
    experts, with its ids and weights (8 bytes a slot), to the rank at its own position there
    (over its own NIC), which hands the pairs on inside that island; the combine sums them
    there and sends one partial sum back across. Charging each pair across instead (k x (m-1)/m
    copies a token, 4 of DeepSeek's 8 over 2 nodes against about 1) overcharged EP prefill over
    the network several times over."""
    s, w = cm.s, cm.w
    k, ep = s.top_k, g.size
    act_row = s.hidden * w.act_bytes
    disp_row = s.hidden * (1 if w.dtype == "fp8" else w.act_bytes)
    mean = n_all / ep  # tokens an ep rank routes on average (one DP rank may hold them all)
    r = pairs / vmax(n_all * k / ep, 1e-9)  # the busiest rank's pairs over the mean
    counts = 8 * s.experts  # each destination's rows per expert, exchanged first (host sizes)
    if g.islands == 1:
        sent = vmax(per_rank * k, pairs)
        return (all_to_all(counts, g) + all_to_all(sent * disp_row, g)
                + all_to_all(sent * act_row, g))
    m, per_island = g.islands, g.per_island
    touched = (m - 1) * (1 - (1 - 1 / m) ** k)  # remote islands a token's k experts reach
    # the busiest island's excess is its busiest rank's, spread over the island's ranks
    r_island = 1 + (r - 1) / per_island
    cross = touched * vmax(per_rank, mean * r_island)  # rows over the rail, sent or received
    # inside the island a rank hands on its own pairs there and those relayed to it
    intra = vmax(k / m * (per_rank + (m - 1) * mean), pairs)
    dispatch = (island_first_all_to_all(counts, counts, g)
                + island_first_all_to_all(cross * (disp_row + 8 * k), intra * disp_row, g))
    return dispatch + island_first_all_to_all(cross * act_row, intra * act_row, g)


def _pairs_over_rdma(cm, g, per_rank, pairs):
    """Dispatch and combine with DeepEP's low-latency kernels, as SGLang's decode runs them
    (lmsys.org large-scale EP blog: normal dispatch for prefill, low-latency dispatch for
    decode; DeepEP README: low-latency kernels are pure RDMA): every (token, expert) pair is
    its own row to its expert's rank, with its id and weight (8 bytes), and comes back as its
    own row in the combine; no island-first deduplication, no receive counts exchanged first
    (fixed-size buffers)."""
    s, w = cm.s, cm.w
    act_row = s.hidden * w.act_bytes
    disp_row = s.hidden * (1 if w.dtype == "fp8" else w.act_bytes)
    sent = vmax(per_rank * s.top_k, pairs)
    return all_to_all(sent * (disp_row + 8), g) + all_to_all(sent * act_row, g)
