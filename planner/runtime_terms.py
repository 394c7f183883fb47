"""The cost model's terms on a calibrated machine: what `atoll calibrate` measured there, and
what atoll's own runtime does on it beyond the roofline, so `atoll plan --check` compares
like with like.

- GEMM rate at the GEMM's rows and read bandwidth, per rank, from the measured tables, at the
  share of a core a rank got with as many ranks at once (calibration.cpu_share; past the
  measured counts, or without them, ranks beyond the cores share them).
- Launch/dispatch overhead: per decoder layer (dense or MoE) and per tick (scheduling,
  metadata, sampling: a fixed part and a part per sequence), measured on tiny checkpoints.
- Each tick's token exchange (engine.rank.runner.tick): a broadcast of the sampled tokens over the
  world, or with DP the `agree` all_reduce and the token table's all_reduce.
- The MoE exchange as layers/moe.py picks it: gather_combine at <= GATHER_MAX_ROWS rows per ep
  rank, whose torch path (no Triton on a CPU) runs every gathered row through every local
  expert, else the all_to_all dispatch and combine with a count exchange; DP first gathers the
  stage's tokens when the experts are not split like attention (tp != moe_tp).

On a GPU node (calibration.device cuda) only the first of these applies: the GEMM rates and
HBM read bandwidth are the GPU's measured ones, at a share of 1 (each rank has its own GPU),
and planner/collectives.py takes NCCL's measured collectives. The overhead, MoE-exchange and
tick terms stay CPU-only (CostModel.runtime): calibrate measured the GPU's overhead on eager
steps, while the runtime captures its GPU decode step in CUDA graphs without that host
dispatch, so there the sourced per-kernel floor and MoE model stand.
"""

from __future__ import annotations

import math

import numpy as np

from atoll.planner.parts import is_many
from atoll.planner.workload import gather_max_rows  # the runtime's threshold (the config's moe_gather_rows)
from atoll.planner.categories import EXPERTS, WEIGHTS
from atoll.planner.collectives import all_gather, all_reduce, all_to_all
from atoll.planner.moe_cost import expected_busiest_experts


def _reduce_scatter(nbytes: float, g) -> float:
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    fig = g.measured.collective("reduce_scatter", g.size) if g.measured is not None else None
    return all_reduce(nbytes, g) if fig is None else fig[0] + nbytes / fig[1]


def _broadcast(nbytes: float, g) -> float:
    if g.size <= 1:
        return 0.0
    fig = g.measured.collective("broadcast", g.size) if g.measured is not None else None
    return all_reduce(nbytes, g) if fig is None else fig[0] + nbytes / fig[1]


class Measured:
    def __init__(self, cal, workload, ranks: int):
        self.cal, self.w = cal, workload
        self.share = cal.share(ranks)  # a rank's compute beside the others, over one rank alone
        bw = cal.memory_bytes_s(ranks)
        self.bandwidth = bw
        self._max_rows = None

    def gemm(self, rows):
        """FLOP/s of a GEMM of `rows` rows on one rank (an array of row counts: each looked up
        once); None where the dtype was not measured."""
        if not is_many(rows):
            rate = self.cal.gemm_flops(self.w.dtype, rows)
            return None if rate is None else rate * self.share
        if not self.cal.gemm_tflops.get(self.w.dtype):
            return None
        values, back = np.unique(rows, return_inverse=True)
        return np.array([self.cal.gemm_flops(self.w.dtype, v) * self.share for v in values.tolist()])[back]

    def _over(self, name: str) -> float:
        return (self.cal.overhead_s(name) or 0.0) / self.share

    def layer_overhead(self, dense: bool, seqs: int) -> float:
        """One decoder layer beyond its products, for `seqs` sequences on this rank."""
        return self._over("dense_layer" if dense else "moe_layer") + self._over("seq_layer") * seqs

    def tick_overhead(self, seqs: int) -> float:
        return self._over("step") + self._over("per_seq") * seqs

    def tick_exchange(self, cm, seqs: int) -> dict[str, float]:
        """Seconds each rank spends per tick handing out the sampled tokens."""
        g, l = cm.g_world, cm.l
        if g.size <= 1:
            return {}
        name = f"token exchange over {g.kind}"
        if l.dp == 1:
            return {name: _broadcast(8 * seqs, g)}
        return {name: all_reduce(16, g) + all_reduce(8 * l.dp * seqs, g)}

    @property
    def max_rows(self) -> int:
        if self._max_rows is None:
            self._max_rows = gather_max_rows()
        return self._max_rows

    def moe(self, cm, out, *, n: int, n_all: int, wb: int) -> None:
        """One MoE layer's experts and exchange on one rank; n: tokens of its DP rank, n_all:
        tokens of the stage (n x active DP ranks)."""
        s, l, w = cm.s, cm.l, cm.w
        g_ep, g_tp = cm.g_stage, cm.g_tp  # the ep group is the stage's ranks when moe_tp is 1
        local, per_expert = s.experts_per_rank(l.ep, w.redundant_experts), s.expert / l.moe_tp
        row = s.hidden * w.act_bytes
        name_ep = f"MoE exchange over {g_ep.kind}"
        cm._op(out, s.router * w.act_bytes, 2 * n * s.router, WEIGHTS, rows=n)
        if s.shared_expert:
            shared = s.shared_expert / l.tp
            cm._op(out, shared * wb, 2 * n * shared, WEIGHTS, rows=n)
        direct = l.tp == l.moe_tp
        if direct:
            rows, exchange = n, 0.0
            if l.ep > 1:
                exchange += all_gather(8 * l.ep, g_ep)  # row_counts: every rank's count
        else:
            rows, exchange = n_all, 0.0
            if l.dp > 1:  # the stage's tokens gathered over dp first (all_gather_rows)
                exchange += all_gather(8 * l.dp, g_ep) + all_gather(n_all * row, g_ep)
        per_rank = rows if direct else math.ceil(rows / l.ep)
        if per_rank <= self.max_rows:  # gather_combine: every row through every local expert
            seen = rows * l.ep if direct else rows
            cm._op(out, local * per_expert * wb, 2 * seen * local * per_expert, EXPERTS, rows=seen)
            if direct and l.ep > 1:
                exchange += all_gather(seen * (row + 8 * s.top_k), g_ep) + _reduce_scatter(seen * row, g_ep)
            elif l.ep > 1:
                exchange += all_reduce(seen * row, g_ep)
        else:  # all_to_all dispatch and combine of this rank's rows (a count exchange first)
            routed = per_rank * s.top_k  # (token, expert) pairs this rank sends, uniform routing
            busiest = expected_busiest_experts(per_rank * l.ep, s.experts, s.top_k, l.ep)
            here = routed  # pairs arriving here, on average
            cm._op(out, busiest * per_expert * wb, 2 * here * per_expert, EXPERTS,
                   rows=max(1.0, here / max(busiest, 1.0)))
            exchange += all_to_all(8 * l.ep, g_ep) + 2 * all_to_all(routed * row, g_ep)
            if not direct:
                exchange += all_gather(rows * row, g_ep)  # the chunks back to every ep rank
        if l.moe_tp > 1:
            exchange += all_reduce(n * row, g_tp)
        out[name_ep] += exchange
