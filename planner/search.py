"""Search: every layout the model and cluster admit, each costed and fitted.

A candidate is `replicas x Layout(tp, pp, dp, ep, moe_tp)` with replicas x world = GPUs of
the cluster. TP stays inside an NVLink island (inside a node when there is no NVLink) unless
crossing is allowed; dense models take no DP or EP (replicas are their data parallelism).
"""

from __future__ import annotations

import math
import re

from atoll.errors import AtollError, ConfigError
from atoll.parallel.layout import Layout, divisors
from atoll.parallel.placement import Placement, tp_domain_size
from atoll.planner.cost import CostModel
from atoll.planner.memory import memory_fit
from atoll.planner import efficiency as eff
from atoll.planner.plan import Prediction
from atoll.planner.serving import poisson_weights, steady_state

_REPLICAS = re.compile(r"^\s*(\d+)\s*[xX*]\s*(.+)$")


def parse_candidate(text: str, num_gpus: int) -> tuple[Layout, int]:
    """"TP8PP2" -> (layout, replicas filling the cluster); "2 x TP8" -> exactly 2 replicas."""
    m = _REPLICAS.match(text)
    layout = Layout.parse(m.group(2) if m else text)
    replicas = int(m.group(1)) if m else max(1, num_gpus // layout.world_size)
    if replicas * layout.world_size > num_gpus:
        raise ConfigError(f"{text} needs {replicas * layout.world_size} GPUs; the cluster has {num_gpus}")
    return layout, replicas


def enumerate_layouts(config, topology, *, allow_cross_island: bool = False) -> list[tuple[Layout, int]]:
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
    return out


def evaluate(config, shapes, topology, workload, layout: Layout, replicas: int, *,
             allow_cross_island: bool = False) -> Prediction:
    placement = Placement.build(layout, topology, allow_cross_island=allow_cross_island)
    busy = min(topology.gpus_per_node, replicas * layout.world_size)  # ranks at work on one node
    cost = CostModel(config, shapes, topology, workload, layout, placement, ranks=busy)
    conc = workload.concurrency
    batch = math.ceil(conc / replicas)
    offered = workload.request_rate
    # steady serving: prompt chunks beside decode (TPOT), queueing for the prefill (TTFT)
    st = steady_state(lambda n, k, length: cost.decode(n, k, length)[0], isl=workload.isl, osl=workload.osl,
                      concurrency=batch, budget=eff.PREFILL_CHUNK_TOKENS,
                      rate=None if offered is None else offered / replicas)
    tpot = st.tpot_s
    # the mean step's parts: each chunk count's step weighted by its probability, at the
    # nearest whole decode batch, scaled to TPOT
    decode: dict[str, float] = {}
    for k, weight in poisson_weights(st.chunks_per_step, st.chunk_cap):
        for name, v in cost.decode(max(1, round(st.decode_batch)), k, st.chunk_tokens)[1].items():
            decode[name] = decode.get(name, 0.0) + weight * v
    mean = sum(decode.values())
    decode = {k: v * tpot / mean for k, v in decode.items()}
    _, _, prefill = cost.prefill(1)
    gpus = replicas * layout.world_size
    # closed loop: each of the `conc` clients sends at a replica's per-client rate (with fewer
    # clients than replicas some stand idle); open loop: every replica takes its share
    rate = st.rate * (replicas if offered is not None else conc / batch)
    band, ttft_band = prediction_bands(topology)
    return Prediction(band=band, ttft_band=ttft_band,
        layout=layout, replicas=replicas, gpus=gpus, concurrency=conc,
        memory=memory_fit(config, shapes, topology, workload, layout, batch),
        ttft_s=st.ttft_s, tpot_s=tpot, tokens_per_s_per_gpu=rate * workload.osl / gpus,
        tokens_per_s_per_user=1.0 / tpot, decode=decode, prefill=prefill,
        arrival_rate=rate, offered_rate=offered, prefill_load=st.load,
        overload=st.why,
    )


def prediction_bands(topology) -> tuple[float, float]:
    """(TPOT, TTFT) relative error bands: what `atoll plan --check --record` measured on this
    topology, else the sourced defaults of efficiency.py."""
    errors = topology.calibration.errors if topology.calibration is not None else {}
    return errors.get("tpot", eff.PREDICTION_BAND_TPOT), errors.get("ttft", eff.PREDICTION_BAND_TTFT)
