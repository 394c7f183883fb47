"""Goodput per GPU under TTFT and TPOT SLOs, colocated against disaggregated (xPyD), from the
analytic cost model: the comparison DistServe (OSDI'24) makes, without the simulator.

- Colocated: one replica of `layout` serving Poisson arrivals with chunked prefill (serving.py);
  its goodput is the highest request rate whose mean TTFT and TPOT meet the SLOs (bisection).
- Prefill engine: prompts one at a time, each taking S = one prompt's prefill pass; Poisson
  arrivals queue before it (M/D/1): TTFT = S + ρS / (2(1 - ρ)), ρ = rate x S. Its goodput is the
  highest rate with TTFT within the SLO.
- Decode engine: a step of n sequences takes step(n); by Little's law n = rate x osl x step(n).
  Its goodput is the highest n / (osl x step(n)) with step(n) within the TPOT SLO and n fitting
  in its memory.
- xPyD: x prefill and y decode engines serve min(x Rp, y Rd) requests/s on x Wp + y Wd GPUs.

Assumed: mean TTFT and TPOT stand for the percentile a source's SLO names; the KV hand-off
from prefill to decode engine is not charged (DistServe places both on one node).
"""

from __future__ import annotations

import dataclasses
import math

from atoll.parallel.layout import Layout
from atoll.planner import plan_layouts
from atoll.planner.memory import memory_fit
from atoll.planner.points import cost_model
from atoll.planner.serving import md1_wait

_BISECT = 40


def _highest(ok, hi: float) -> float:
    """The largest x in [0, hi] with ok(x), ok falling once (bisection)."""
    lo = 0.0
    if ok(hi):
        return hi
    for _ in range(_BISECT):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def colocated_rate(model, topology, layout: str, workload, *, ttft_s: float, tpot_s: float) -> float:
    """Requests/s one colocated replica serves within both SLOs."""
    def ok(rate: float) -> bool:
        if rate <= 0:
            return True
        w = dataclasses.replace(workload, request_rate=rate)
        p = plan_layouts(model, topology, w, layouts=[f"1 x {layout}"]).predictions[0]
        return p.sustainable and p.ttft_s <= ttft_s and p.tpot_s <= tpot_s

    one = cost_model(model, topology, layout, workload)[0].prefill(1)[0]
    return _highest(ok, 1.0 / one)


def prefill_rate(model, topology, layout: str, workload, *, ttft_s: float) -> float:
    """Requests/s one prefill engine serves within the TTFT SLO."""
    service = cost_model(model, topology, layout, workload)[0].prefill(1)[0]
    return _highest(lambda r: service + md1_wait(r, service) <= ttft_s, 1.0 / service)


def decode_rate(model, topology, layout: str, workload, *, tpot_s: float, most: int = 4096) -> float:
    """Requests/s one decode engine serves within the TPOT SLO."""
    cm, lay = cost_model(model, topology, layout, workload)
    best = 0.0
    n = 1
    while n <= most:
        step = cm.decode(n)[0]
        if step > tpot_s or not memory_fit(cm.c, cm.s, topology, cm.w, lay, n).fits:
            break
        best = max(best, n / (workload.osl * step))
        n = n + 1 if n < 64 else math.ceil(n * 1.05)
    return best


def disaggregated_gain(model, topology, workload, *, colocated: str, prefill: str, decode: str,
                       x: int, y: int, ttft_s: float, tpot_s: float) -> float:
    """Goodput per GPU of x prefill and y decode engines over that of colocated replicas."""
    wc, wp, wd = (Layout.parse(t).world_size for t in (colocated, prefill, decode))
    rc = colocated_rate(model, topology, colocated, workload, ttft_s=ttft_s, tpot_s=tpot_s) / wc
    rp = prefill_rate(model, topology, prefill, workload, ttft_s=ttft_s)
    rd = decode_rate(model, topology, decode, workload, tpot_s=tpot_s)
    return min(x * rp, y * rd) / (x * wp + y * wd) / rc
