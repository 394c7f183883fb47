"""The autoscaler at work (--autoscale): every `every_s` seconds it looks at the server's load
(serve.metrics' histograms and the engines' counters), asks serve.autoscale.decide what to
change, and does it through the admin API (serve.admin.EngineAdmin). Every decision is
logged with its reason, kept (GET /admin/autoscale) and counted in /metrics
(atoll_autoscale_decisions_total{action,role}).

Attainment is read from the latency histograms: the first tokens (and inter-token gaps) that
fell in buckets at or under the SLO since the last look, over all of them; an SLO between two
bucket bounds counts at the bound below it (the stricter reading).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from prometheus_client import Counter

from atoll.serve.autoscale import Fleet, Goodput, Policy, Sample, decide

KEEP = 1000  # decisions kept for GET /admin/autoscale


def _within(histogram, slo_s: float) -> tuple[float, float]:
    """(observations at or under the largest bucket bound <= slo_s, all observations) so far."""
    ok = total = 0.0
    best = -1.0
    for metric in histogram.collect():
        for s in metric.samples:
            if not s.name.endswith("_bucket"):
                continue
            le = float(s.labels["le"])
            if le == float("inf"):
                total = s.value
            elif best < le <= slo_s:
                best, ok = le, s.value
    return ok, total


class Scaler:
    def __init__(self, admin, metrics, goodput: Goodput, policy: Policy | None = None, *, every_s: float = 5.0,
                 stats=None, log=None):
        """stats(): the engines' counters (waiting, blocks_in_use, num_blocks); log(line): where
        decisions are told (default: the admin's log)."""
        self.admin, self.metrics, self.goodput = admin, metrics, goodput
        self.policy, self.every_s = policy or Policy(), every_s
        self.stats = stats or (lambda: admin.replicas.stats)
        self.log = log or admin.log
        self.history: deque[Sample] = deque(maxlen=1000)
        self.decisions: deque[dict] = deque(maxlen=KEEP)
        self.last_at: float | None = None
        self._seen = {"ttft": (0.0, 0.0), "itl": (0.0, 0.0)}
        self.counted = Counter("atoll_autoscale_decisions", "--autoscale: decisions made, by action (add, drain, "
                               "role, threshold) and role", ["action", "role"], registry=metrics.registry)

    def _share(self, name: str, histogram, slo_s: float) -> float | None:
        ok, total = _within(histogram, slo_s)
        ok0, total0 = self._seen[name]
        self._seen[name] = (ok, total)
        return (ok - ok0) / (total - total0) if total > total0 else None

    def sample(self, now: float) -> Sample:
        stats = self.stats()
        blocks = stats.get("num_blocks", 0)
        return Sample(now, self._share("ttft", self.metrics.ttft, self.goodput.ttft_s),
                      self._share("itl", self.metrics.itl, self.goodput.tpot_s), float(stats.get("waiting", 0)),
                      stats.get("blocks_in_use", 0) / blocks if blocks else 0.0)

    def fleet(self) -> Fleet:
        states = [self.admin.state(k) for k in range(len(self.admin.replicas.engines))]
        return Fleet(replicas=states.count("serving"),
                     free=sum(s in ("drained", "draining", "removed") for s in states))

    def tick(self, now: float | None = None):
        """One look: sample, decide, act. Returns the decision made (or None)."""
        now = time.monotonic() if now is None else now
        self.history.append(self.sample(now))
        d = decide(list(self.history), self.fleet(), self.goodput, self.policy, now=now, last_at=self.last_at)
        if d is None:
            return None
        self.last_at = now
        engine = self._act(d)
        self.counted.labels(d.action, d.role).inc()
        self.decisions.append({"at": time.time(), "action": d.action, "role": d.role, "engine": engine,
                               "reason": d.reason})
        self.log(f"autoscale: {d.action} {d.role} (engine {engine}): {d.reason}")
        return d

    def _act(self, d) -> int | None:
        """Apply a replicas fleet's decision through the admin API; the engine it touched."""
        if d.action == "add":
            return self.admin.add(why=f"autoscale: {d.reason}")["id"]
        if d.action == "drain":
            serving = [k for k in range(len(self.admin.replicas.engines)) if self.admin.state(k) == "serving"]
            k = min(reversed(serving), key=lambda j: self.admin.replicas.state(j)[1])  # the least loaded, the last
            return self.admin.drain(k, why=f"autoscale: {d.reason}")["id"]
        raise NotImplementedError(f"autoscale {d.action} on a replicas fleet")  # decide makes none there

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            await asyncio.to_thread(self.tick)
