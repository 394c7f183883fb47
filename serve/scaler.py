"""The autoscaler at work (--autoscale): every `every_s` seconds it looks at the server's load
(serve.metrics' histograms and the engines' counters), asks serve.autoscale.decide what to
change, and does it through the admin API (serve.admin.EngineAdmin). Every decision is
logged with its reason, kept (GET /admin/autoscale) and counted in /metrics
(atoll_autoscale_decisions_total{action,role,applied}). On a disaggregated server the
local-prefill threshold, and which engines prefill and which decode (serve.scaler_disagg).

With a serve.predict.Predictor (the planner's step costs, corrected live), each sample carries
its estimates of the prefill queue's wait and of TPOT, and each logged decision the engines'
predicted steps and correction factors, in its one line.

Attainment is read from the latency histograms: the first tokens (and inter-token gaps) that
fell in buckets at or under the SLO since the last look, over all of them; an SLO between two
bucket bounds counts at the bound below it (the stricter reading).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from prometheus_client import Counter

from atoll.serve.autoscale import Fleet, Goodput, Policy, Sample, decide, direction

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


def _total(metric, suffix: str) -> float:
    """A counter's total (suffix "_total") or a histogram's count ("_count")."""
    return sum(s.value for m in metric.collect() for s in m.samples if s.name.endswith(suffix))


class ReplicasTarget:
    """What --autoscale changes on a replicas server: its engines, through the admin API."""

    def __init__(self, admin):
        self.admin, self.log = admin, admin.log

    def stats(self) -> dict:
        return self.admin.replicas.stats

    def fleet(self) -> Fleet:
        states = [self.admin.state(k) for k in range(len(self.admin.replicas.engines))]
        return Fleet(replicas=states.count("serving"), free=sum(s in ("drained", "draining", "removed") for s in states))

    def act(self, d) -> tuple[int | None, bool]:
        """(the engine it touched, whether the decision was applied)."""
        if d.action == "add":
            return self.admin.add(why=f"autoscale: {d.reason}")["id"], True
        serving = [k for k in range(len(self.admin.replicas.engines)) if self.admin.state(k) == "serving"]
        k = min(reversed(serving), key=lambda j: self.admin.replicas.state(j)[1])  # the least loaded, the last
        return self.admin.drain(k, why=f"autoscale: {d.reason}")["id"], True


class Scaler:
    def __init__(self, target, metrics, goodput: Goodput, policy: Policy | None = None, *, every_s: float = 5.0,
                 predictor=None):
        """target: ReplicasTarget or DisaggTarget (its stats, fleet, act and log); predictor:
        serve.predict.Predictor, or None (no estimates: attainment and KV use only)."""
        self.target, self.metrics, self.goodput, self.predictor = target, metrics, goodput, predictor
        self._prompts = (0.0, 0.0, 0.0)  # prompt tokens computed and requests finished so far, the last mean
        self.policy, self.every_s = policy or Policy(), every_s
        self.history: deque[Sample] = deque(maxlen=1000)
        self.decisions: deque[dict] = deque(maxlen=KEEP)
        self.last_at: float | None = None
        self.last: str | None = None  # the last decision's direction (serve.autoscale.direction)
        self._seen = {"ttft": (0.0, 0.0), "itl": (0.0, 0.0)}
        self.counted = Counter("atoll_autoscale_decisions", "--autoscale: decisions made, by action (add, drain, "
                               "role, threshold), role and whether applied (not when no engine was free to take it)", ["action", "role", "applied"],
                               registry=metrics.registry)

    def _share(self, name: str, histogram, slo_s: float) -> float | None:
        ok, total = _within(histogram, slo_s)
        ok0, total0 = self._seen[name]
        self._seen[name] = (ok, total)
        return (ok - ok0) / (total - total0) if total > total0 else None

    def _prompt(self) -> float:
        """The mean prompt tokens computed (not found in the prefix cache) of the requests that
        finished since the last look (the last mean seen when none did)."""
        tokens = _total(self.metrics.prompt_tokens, "_total") - _total(self.metrics.cached_tokens, "_total")
        finished = _total(self.metrics.finished, "_total")
        t0, f0, last = self._prompts
        mean = (tokens - t0) / (finished - f0) if finished > f0 else last
        self._prompts = (tokens, finished, mean)
        return mean

    def sample(self, now: float) -> Sample:
        stats = self.target.stats()
        blocks = stats.get("num_blocks", 0)
        waiting = float(stats.get("waiting", 0))
        est = {}
        if self.predictor is not None:
            est = self.predictor.estimate(self.target.fleet(), waiting=waiting, running=float(stats.get("running", 0)),
                                          prompt=self._prompt())
        return Sample(now, self._share("ttft", self.metrics.ttft, self.goodput.ttft_s),
                      self._share("itl", self.metrics.itl, self.goodput.tpot_s), waiting,
                      stats.get("blocks_in_use", 0) / blocks if blocks else 0.0, **est)

    def steps(self) -> list[str]:
        """Each engine's predicted step and correction factor, a line each (none without a predictor)."""
        return [v["line"] for v in self.predictor.view().values()] if self.predictor is not None else []

    def tick(self, now: float | None = None):
        """One look: sample, decide, act. Returns the decision made (or None)."""
        now = time.monotonic() if now is None else now
        sample = self.sample(now)
        self.history.append(sample)
        fleet = self.target.fleet()
        d = decide(list(self.history), fleet, self.goodput, self.policy, now=now, last_at=self.last_at, last=self.last)
        if d is None:
            return None
        self.last_at, self.last = now, direction(d, fleet)
        engine, applied = self.target.act(d)
        self.counted.labels(d.action, d.role, str(applied).lower()).inc()
        steps = self.steps()
        ms = lambda s: None if s is None else round(s * 1000, 3)  # noqa: E731
        self.decisions.append({"at": time.time(), "action": d.action, "role": d.role, "engine": engine,
                               "threshold": d.threshold, "applied": applied, "reason": d.reason,
                               "estimated_queue_ms": ms(sample.queue_s), "estimated_tpot_ms": ms(sample.tpot_s),
                               "correction": sample.correction, "tpot_correction": sample.tpot_correction,
                               "steps": steps})
        where = f" (engine {engine})" if engine is not None else ""
        self.target.log(f"autoscale: {d.action} {d.role}{where}: {d.reason}" + ("" if applied else
                        " [not applied: no engine free to take it]")
                        + (f" [steps: {'; '.join(steps)}]" if steps else ""))
        return d

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            await asyncio.to_thread(self.tick)
