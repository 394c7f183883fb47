"""One MoE layer's cost in a decode or prefill pass: the busiest EP rank's expert reads, the
shared expert, and the exchange that brings tokens to their experts and back."""

from __future__ import annotations

from atoll.planner.categories import EXPERTS, WEIGHTS
from atoll.planner.collectives import all_gather, all_reduce, all_to_all


def expected_busiest_experts(tokens: int, experts: int, top_k: int, ranks: int) -> float:
    """Expected number of distinct experts the busiest EP rank runs for `tokens` tokens, under
    uniform top-k routing: each rank's count is Binomial(local, p), p = 1-(1-k/E)^tokens,
    local = ceil(E/ranks) as the runtime splits them (comm.routing.expert_split: the busiest
    rank holds the extra one), and E[max of `ranks` draws] = sum_x (1 - F(x)^ranks)."""
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



def moe_layer(cm, out, *, n: int, n_all: int, act: float, wb: int):
    """Adds one MoE layer's expert reads, shared expert and exchange to `out` (seconds by
    category). n: tokens on one DP rank; n_all: tokens entering the layer over the stage."""
    s, l = cm.s, cm.l
    # routed experts: the busiest EP rank's distinct experts, each 1/moe_tp of its weights
    busiest = expected_busiest_experts(n_all, s.experts, s.top_k, l.ep)
    per_expert = s.expert / l.moe_tp
    tokens_here = n_all * s.top_k / l.ep
    cm._op(out, busiest * per_expert * wb, 2 * tokens_here * per_expert, EXPERTS)
    shared = s.shared_expert / l.tp
    if shared:
        cm._op(out, shared * wb + s.router * 2, 2 * n * shared, WEIGHTS)
    if l.dp == 1:
        # attention output is replicated on the stage: each rank runs its experts on every
        # token and one all-reduce over the stage (== the TP group) combines them
        out[cm._comm_name("TP all-reduce", cm.g_tp)] += all_reduce(act, cm.g_tp)
        return
    # DP attention: tokens go to the ranks holding their experts and back over the stage.
    # A token's copies: one per selected expert (DeepEP low-latency style, no dedup) when
    # experts are whole (ep >= top_k), one per EP group otherwise; each copy goes to all
    # moe_tp shards of its expert. fp8 dispatch when the weights are fp8, bf16 combine.
    per_rank = n / l.tp  # each TP rank of a DP group dispatches its slice of the tokens
    copies = min(s.top_k, l.ep) * l.moe_tp
    disp = per_rank * copies * s.hidden * (1 if cm.w.dtype == "fp8" else 2)
    comb = per_rank * copies * s.hidden * 2
    name = cm._comm_name("all-to-all", cm.g_stage)
    out[name] += all_to_all(disp, cm.g_stage) + all_to_all(comb, cm.g_stage)
    if l.tp > 1:
        out[cm._comm_name("TP all-gather", cm.g_tp)] += all_gather(act, cm.g_tp)
