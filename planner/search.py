"""Search: every layout the model and cluster admit, each costed and fitted.

A candidate is `replicas x Layout(tp, pp, dp, ep, moe_tp)` with replicas x world = GPUs of
the cluster. TP stays inside an NVLink island (inside a node when there is no NVLink) unless
crossing is allowed; dense models take no DP or EP (replicas are their data parallelism).
"""

from __future__ import annotations

import dataclasses
import math
import re

from atoll.errors import AtollError, ConfigError
from atoll.parallel.layout import Layout, divisors
from atoll.parallel.placement import Placement, tp_domain_size
from atoll.planner import efficiency as eff
from atoll.planner.context import with_cp
from atoll.planner.cost import CostModel
from atoll.planner.memory import memory_fit
from atoll.planner.plan import Prediction
from atoll.planner.serving import Replicas, chunking, poisson_weights
from atoll.planner.steps import Tables

_REPLICAS = re.compile(r"^\s*(\d+)\s*[xX*]\s*(.+)$")


def parse_candidate(text: str, num_gpus: int) -> tuple[Layout, int]:
    """"TP8PP2" -> (layout, replicas filling the cluster); "2 x TP8" -> exactly 2 replicas;
    "TP8CP2": a cp layout (context.py)."""
    m = _REPLICAS.match(text)
    layout = Layout.parse(m.group(2) if m else text)
    replicas = int(m.group(1)) if m else max(1, num_gpus // layout.world_size)
    if replicas * layout.world_size > num_gpus:
        raise ConfigError(f"{text} needs {replicas * layout.world_size} GPUs; the cluster has {num_gpus}")
    return layout, replicas


def enumerate_layouts(config, topology, *, allow_cross_island: bool = False,
                      max_cp: int = 1) -> list[tuple[Layout, int]]:
    """Every candidate without context parallelism, in the order the search has always listed
    them; then, with max_cp > 1, each of those without attention DP again at every cp from 2 to
    max_cp that the cluster's GPUs divide (context.py)."""
    n = topology.num_gpus
    max_tp = n if allow_cross_island else tp_domain_size(topology)
    out = []
    for world in divisors(n):
        for pp in divisors(world):
            if pp > config.num_hidden_layers:
                continue
            for tp in divisors(world // pp):
                if tp > max_tp or (not allow_cross_island and max_tp % tp):
                    continue
                dp = world // pp // tp
                if dp > 1 and not config.is_moe:
                    continue  # for a dense model DP inside a stage is just replicas
                for ep in (divisors(tp * dp) if config.is_moe else [1]):
                    if config.is_moe and (ep > config.num_experts or config.num_experts % ep):
                        continue
                    try:
                        layout = Layout(tp=tp, pp=pp, dp=dp, ep=ep).validate(config)
                    except AtollError:
                        continue
                    out.append((layout, n // world))
    base = [lay for lay, _ in out if lay.dp == 1 and lay.ep == 1 and not config.is_mla]
    for cp in range(2, max_cp + 1):
        for layout in base:
            world = layout.world_size * cp
            if n % world == 0:
                out.append((with_cp(layout, cp), n // world))
    return out


def evaluate(config, shapes, topology, workload, layout: Layout, replicas: int, *,
             allow_cross_island: bool = False) -> Prediction:
    """One layout at one workload (evaluate_all on one candidate)."""
    return evaluate_all(config, shapes, topology, [workload], [(layout, replicas)],
                        allow_cross_island=allow_cross_island)[0][0]


def evaluate_all(config, shapes, topology, workloads, cands, *, allow_cross_island: bool = False,
                 progress=None) -> list[list[Prediction]]:
    """Predictions of every candidate (layout, replicas) at every workload: [workload][candidate].

    What does not depend on the concurrency is done once per layout: its placement, its cost
    model, its table of steps (steps.py) and its prefill; the fixed points of steady serving
    are solved for every layout and workload at once (serving.Replicas). Workloads that differ
    in more than concurrency and request rate (prompt or output lengths, precisions) get their
    own tables. progress(done, total): called as each layout's steps are costed, twice a layout
    and group (its table, then its mean step's breakdown)."""
    placements = [Placement.build(lay, topology, allow_cross_island=allow_cross_island) for lay, _ in cands]
    groups: dict = {}
    for i, w in enumerate(workloads):  # the cost model reads neither concurrency nor request rate
        groups.setdefault(dataclasses.replace(w, concurrency=1, request_rate=None), []).append(i)
    out: list[list] = [[] for _ in workloads]
    if not cands:
        return out
    count = _Count(2 * len(cands) * len(groups), progress)
    for members in groups.values():
        for i, preds in zip(members, _evaluate_group(config, shapes, topology, [workloads[i] for i in members],
                                                     cands, placements, count)):
            out[i] = preds
    return out


class _Count:
    """Units done so far, told to progress(done, total) (nothing without one)."""

    def __init__(self, total: int, progress):
        self.done, self.total, self.progress = 0, total, progress

    def __call__(self, n: int = 1) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.done, self.total)


def _evaluate_group(config, shapes, topology, workloads, cands, placements, progress):
    w0 = workloads[0]
    costs = [CostModel(config, shapes, topology, w0, lay, pl, ranks=min(topology.gpus_per_node, reps * lay.world_size))
             for (lay, reps), pl in zip(cands, placements)]
    # lanes: every candidate at every workload, workload-major
    lanes = [(wi, ci) for wi in range(len(workloads)) for ci in range(len(cands))]
    batch = [math.ceil(workloads[wi].concurrency / cands[ci][1]) for wi, ci in lanes]
    offered = [workloads[wi].request_rate for wi, _ in lanes]
    rates = [math.nan if r is None else r / cands[ci][1] for r, (_, ci) in zip(offered, lanes)]
    most = [0] * len(cands)  # the largest batch of each layout's lanes
    for b, (_, ci) in zip(batch, lanes):
        most[ci] = max(most[ci], b)
    budget = eff.prefill_chunk_tokens(topology.gpu)  # the runtime's step token budget there
    _, chunk, cap = chunking(w0.isl, budget)
    tables = Tables(costs, most, chunk=chunk, cap=cap, lay=[ci for _, ci in lanes], progress=progress)
    replicas = Replicas(tables, isl=w0.isl, osl=w0.osl, concurrency=batch, budget=budget,
                        open_loop=[r is not None for r in offered], tokens_per_step=w0.tokens_per_step)
    # steady serving: prompt chunks beside decode (TPOT), queueing for the prefill (TTFT)
    solved = replicas.solve(rates)
    steady = [solved.lane(i) for i in range(len(lanes))]
    decodes = _mean_steps(costs, [ci for _, ci in lanes], steady, chunk, progress)
    prefills = [cm.prefill(1)[2] for cm in costs]
    band, ttft_band = prediction_bands(topology)
    memory: dict = {}
    out = [[None] * len(cands) for _ in workloads]
    for i, (wi, ci) in enumerate(lanes):
        (layout, reps), w, st, decode = cands[ci], workloads[wi], steady[i], decodes[i]
        tpot = st.tpot_s
        gpus = reps * layout.world_size
        # closed loop: each of the `conc` clients sends at a replica's per-client rate (with fewer
        # clients than replicas some stand idle); open loop: every replica takes its share
        rate = st.rate * (reps if offered[i] is not None else w.concurrency / batch[i])
        if (ci, batch[i]) not in memory:
            memory[(ci, batch[i])] = memory_fit(config, shapes, topology, w, layout, batch[i])
        out[wi][ci] = Prediction(
            band=band, ttft_band=ttft_band, layout=layout, replicas=reps, gpus=gpus, concurrency=w.concurrency,
            memory=memory[(ci, batch[i])], ttft_s=st.ttft_s, tpot_s=tpot,
            tokens_per_s_per_gpu=rate * w.osl / gpus, tokens_per_s_per_user=1.0 / tpot, decode=decode,
            prefill=dict(prefills[ci]), arrival_rate=rate, offered_rate=offered[i], prefill_load=st.load,
            overload=st.why)
    return out


def _mean_steps(costs, lay: list[int], steady, chunk: float, progress) -> list[dict[str, float]]:
    """Each lane's mean step by part: each chunk count's step weighted by its probability, at
    the nearest whole decode batch, scaled to TPOT; each layout's steps costed together."""
    weights = [poisson_weights(st.chunks_per_step, st.chunk_cap) for st in steady]
    batches = [max(1, round(st.decode_batch)) for st in steady]
    wanted: list[dict] = [{} for _ in costs]
    for ci, nb, ws in zip(lay, batches, weights):
        for k, _ in ws:
            wanted[ci].setdefault((nb, k), None)
    for ci, cm in enumerate(costs):
        pairs = list(wanted[ci])
        for pair, parts in zip(pairs, cm.decode_many([b for b, _ in pairs], [k for _, k in pairs], chunk)):
            wanted[ci][pair] = parts
        progress(1)
    out = []
    for ci, nb, ws, st in zip(lay, batches, weights, steady):
        decode: dict[str, float] = {}
        for k, weight in ws:
            for name, v in wanted[ci][(nb, k)].items():
                decode[name] = decode.get(name, 0.0) + weight * v
        mean = sum(decode.values())
        out.append({k: v * st.tpot_s / mean for k, v in decode.items()})
    return out


def prediction_bands(topology) -> tuple[float, float]:
    """(TPOT, TTFT) relative error bands: what `atoll plan --check --record` measured on this
    topology, else the sourced defaults of efficiency.py."""
    errors = topology.calibration.errors if topology.calibration is not None else {}
    return errors.get("tpot", eff.PREDICTION_BAND_TPOT), errors.get("ttft", eff.PREDICTION_BAND_TTFT)
