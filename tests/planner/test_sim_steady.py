"""Steady decode fast-forwarded (planner/sim/steady.py) gives the figures of ticking one by one."""

from __future__ import annotations

import math

import pytest

from atoll.planner.sim import steady
from atoll.planner.sim.api import Deployment, prepare
from atoll.planner.sim.load import random_requests, shared_prefix_requests
from atoll.topologies import load_topology

MODEL = "Llama-3.1-8B"
SLOS = {"ttft": 400.0, "tpot": 25.0}


@pytest.fixture(scope="module")
def h200():
    return load_topology("dgx-h200")


def _random(n=160, osl=96):
    return random_requests(n, input_len=384, output_len=osl, vocab_size=32000, seed=5, range_ratio=0.5)


def _shared(n=120):
    return shared_prefix_requests(n, systems=3, system_len=256, user_len=48, output_len=80, vocab_size=32000, seed=2)


CASES = [
    ("one replica, light load", Deployment(layout="TP1", max_num_seqs=32), _random, 4.0, None),
    ("replicas behind the router", Deployment(layout="TP1", replicas=3, max_num_seqs=16), _random, 20.0, None),
    ("prefix caching, few blocks (eviction, preemption)",
     Deployment(layout="TP2", replicas=2, max_num_seqs=16, num_blocks=120, prefix_caching=True), _shared, 15.0, None),
    ("a client cap", Deployment(layout="TP1", replicas=2, max_num_seqs=64), _random, math.inf, 12),
    ("xPyD", Deployment(prefill="TP1", decode="TP2", prefill_replicas=2, max_num_seqs=32), _random, 8.0, None),
]


@pytest.mark.parametrize("name,d,load,rate,cap", CASES, ids=[c[0] for c in CASES])
def test_fast_forward_changes_no_figure(h200, name, d, load, rate, cap):
    reqs = load()
    p = prepare(MODEL, h200, d, reqs)
    slow = p.run(reqs, rate=rate, max_concurrency=cap, slos=SLOS, fast=False)
    fast = p.run(reqs, rate=rate, max_concurrency=cap, slos=SLOS, fast=True)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "duration_s", "goodput", "completed"):
        assert fast["serve"][key] == slow["serve"][key], key
    for a, b in zip(slow["engines"], fast["engines"]):
        assert (a["ticks"], a["preemptions"], a["num_blocks"]) == (b["ticks"], b["preemptions"], b["num_blocks"])
        assert a["busy_share"] == pytest.approx(b["busy_share"], rel=1e-9)
        assert [x["what"] for x in a["bound_by"]] == [x["what"] for x in b["bound_by"]]
    assert slow["routed"] == fast["routed"]


def test_fast_forward_takes_fewer_events_on_a_light_load(h200, monkeypatch):
    """At a light load most ticks are steady decode: far fewer loop events than ticks."""
    reqs = _random(n=40, osl=200)
    p = prepare(MODEL, h200, Deployment(layout="TP1", max_num_seqs=64), reqs)
    planned = []
    real = steady.plan

    def counting(*a, **kw):
        run = real(*a, **kw)
        if run is not None:
            planned.append(run.ticks)
        return run

    monkeypatch.setattr(steady, "plan", counting)
    out = p.run(reqs, rate=0.5)
    ticks = out["engines"][0]["ticks"]
    assert sum(planned) > 0.8 * ticks  # most ticks taken in steady runs
    assert len(planned) < ticks / 10
