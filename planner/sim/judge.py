"""How the SLO search judges one deployment, by simulating it (planner/sim/api.py).

A deployment meets the SLOs at a request rate when at least the target share of its requests
(the attainment, 90% unless told) meet every SLO, as `bench serve --goodput` counts them.
- Without a request rate: its goodput is the highest rate it meets the SLOs at (DistServe's
  definition), found by bisection between a light load and its saturated throughput (raised
  while it still meets them there).
- With one: whether it meets the SLOs at that rate.
Each run simulates enough requests for the deployment's batch slots to fill (its sequences in
flight, at least the requests asked for), and at a finite rate enough for an overload to show in
TTFT or E2EL: arrivals over OVERLOAD_SPAN times the SLO, so that a queue growing at a fifth of the
rate holds the last requests past it. At most MAX_REQUESTS: a large deployment is judged in
steady state and a small one stays fast.

Without prefix caching the router's choice only spreads the load, so R replicas of a layout
are judged as SCALE_TO of them at SCALE_TO / R of the rate (and xPyD as its smallest split of
the same ratio), their rates scaled back: the search's runs stay small on a large cluster.
With prefix caching every replica is simulated, since where a prompt's prefix is cached
decides its route.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from atoll.parallel.layout import Layout
from atoll.planner.sim.api import prepare
from atoll.planner.sim.deploy import Deployment
from atoll.planner.sim.observed import corrected, corrected_slos

MAX_REQUESTS = 1000  # per run: the search's time bound
BISECTIONS = 4  # steps between a light load and saturation: the goodput to ~6% of the saturated rate
OVERLOAD_SPAN = 6  # the load's arrivals span this many times the TTFT (or E2EL) SLO
SCALE_TO = 2  # replicas a colocated deployment is judged by, without prefix caching
EXPANSIONS, EXPAND = 4, 1.3  # above the saturated run's rate: tried at most this often, this much higher
LIGHT = 1 / 32  # the light load, as a share of the saturated throughput


@dataclass(frozen=True)
class Target:
    slos: dict  # metric -> milliseconds (report.SLO_METRICS)
    attainment: float = 0.9  # the share of requests that must meet every SLO
    rate: float | None = None  # requests/s to serve with the fewest GPUs; None: the highest goodput per GPU
    correction: dict | None = None  # measured over simulated {"ttft", "itl"} (observed.py), or None

    def describe(self) -> str:
        slo = " ".join(f"{k}:{v:g}" for k, v in self.slos.items())
        return f"{self.attainment:.0%} of requests within {slo} ms"


@dataclass
class Trial:
    """One simulated run of a deployment at one rate."""
    rate: float
    serve: dict  # report.report's figures
    engines: list

    @property
    def attainment(self) -> float:
        return self.serve["goodput"]["attainment"] or 0.0

    @property
    def by_slo(self) -> dict:
        return self.serve["goodput"]["attainment_by_slo"]

    def binding(self) -> str:
        """The SLO fewest requests meet."""
        return min(self.by_slo.items(), key=lambda kv: kv[1])[0] if self.by_slo else ""

    def point(self, gpus: int) -> tuple[float, float]:
        """(output tokens/s per user, output tokens/s per GPU) of this run."""
        tpot = self.serve["tpot_ms"]["mean"]
        per_user = 1e3 / tpot if tpot else 0.0
        return per_user, (self.serve["output_throughput"] or 0.0) / gpus


@dataclass
class Judged:
    deployment: Deployment
    gpus: int
    meets: bool
    rate: float  # the highest rate that met the SLOs (or the given rate); 0 when none did
    best: Trial | None  # the run at that rate
    limit: Trial | None  # the lightest run that missed (what binds first)
    trials: list = field(default_factory=list)
    steps_from: str = ""

    @property
    def goodput_per_gpu(self) -> float:
        return self.rate / self.gpus if self.meets else 0.0

    @property
    def closest(self) -> Trial | None:
        return self.best if self.meets else self.limit


class Judge:
    """Judges deployments of one model on one topology under one load and target."""

    def __init__(self, config, topology, make_requests, target: Target, *, num_prompts: int,
                 burstiness: float = 1.0, seed: int = 0, model_name: str | None = None, progress=None):
        """make_requests(n): n requests of the load (token-id prompts), the same for every deployment."""
        self.config, self.topology, self.target = config, topology, target
        self.make, self.num_prompts = make_requests, num_prompts
        self.burstiness, self.seed, self.model_name = burstiness, seed, model_name
        self.progress = progress
        self.runs = 0
        self._requests: dict[int, list] = {}
        self._prepared: dict[Deployment, object] = {}  # api.Prepared, built once a deployment
        self.cache: dict[Deployment, Judged] = {}

    def requests(self, d: Deployment, rate: float = math.inf) -> list:
        n = max(self.num_prompts, slots(d))
        queued = [v / 1e3 for k, v in self.target.slos.items() if k in ("ttft", "e2el")]
        if queued and math.isfinite(rate):
            n = max(n, math.ceil(OVERLOAD_SPAN * max(queued) * rate))
        n = min(MAX_REQUESTS, n)
        if n not in self._requests:
            self._requests[n] = self.make(n)
        return self._requests[n]

    def _trial(self, prep, rate: float) -> Trial:
        self.runs += 1
        requests = self.requests(prep.deployment, rate)
        f = self.target.correction
        slos = corrected_slos(self.target.slos, f) if f else self.target.slos
        out = prep.run(requests, rate=rate, burstiness=self.burstiness, seed=self.seed, slos=slos)
        if self.progress is not None:
            self.progress(1)
        return Trial(rate, corrected(out["serve"], f) if f else out["serve"], out["engines"])

    def judge(self, d: Deployment) -> Judged:
        if d not in self.cache:
            small, factor = scaled(d)
            if factor == 1:
                self.cache[d] = self._judge(d)
            else:
                j = self.judge(small)
                self.cache[d] = Judged(d, j.gpus * factor, j.meets, j.rate * factor,
                                       *(_scaled(t, factor) for t in (j.best, j.limit)),
                                       [_scaled(t, factor) for t in j.trials], j.steps_from)
        return self.cache[d]

    def could_beat(self, d: Deployment, old: Judged, margin: float) -> bool:
        """Without a target rate, whether d could have a goodput per GPU above old's by more than
        margin: one run at that rate, instead of a whole bisection for an option that loses (the
        bisection assumes as much: meeting the SLOs at a rate, a deployment meets them below it).
        With a target rate, or where old meets nothing, d is judged whole."""
        if self.target.rate is not None or not old.meets or d in self.cache:
            return True
        prep = self._prepare(scaled(d)[0])
        rate = old.goodput_per_gpu * (1 + margin) * prep.gpus
        return self._trial(prep, rate).attainment >= self.target.attainment

    def _prepare(self, d: Deployment):
        if d not in self._prepared:
            self._prepared[d] = prepare(self.config, self.topology, d, self.requests(d), model_name=self.model_name)
        return self._prepared[d]

    def _judge(self, d: Deployment) -> Judged:
        prep = self._prepare(d)
        goal = self.target.attainment
        if self.target.rate is not None:
            t = self._trial(prep, self.target.rate)
            ok = t.attainment >= goal
            return Judged(d, prep.gpus, ok, self.target.rate, t if ok else None, None if ok else t, [t],
                          prep.steps_from)
        full = self._trial(prep, math.inf)
        saturated = full.serve["request_throughput"] or 0.0
        trials = [full]
        if saturated <= 0:
            return Judged(d, prep.gpus, False, 0.0, None, full, trials, prep.steps_from)
        light = self._trial(prep, saturated * LIGHT)
        trials.append(light)
        if light.attainment < goal:
            return Judged(d, prep.gpus, False, 0.0, None, light, trials, prep.steps_from)
        best, lo, hi = light, light.rate, saturated
        for _ in range(EXPANSIONS):  # a short saturated run can underrate the rate it sustains
            top = self._trial(prep, hi)
            trials.append(top)
            if top.attainment < goal:
                break
            best, lo, hi = top, hi, hi * EXPAND
        else:
            return Judged(d, prep.gpus, True, lo, best, None, trials, prep.steps_from)
        limit = top
        for _ in range(BISECTIONS):
            mid = (lo + hi) / 2
            t = self._trial(prep, mid)
            trials.append(t)
            if t.attainment >= goal:
                best, lo = t, mid
            else:
                limit, hi = t, mid
        return Judged(d, prep.gpus, True, lo, best, limit, trials, prep.steps_from)


def slots(d: Deployment) -> int:
    """The sequences the deployment's engines can hold in flight (each DP rank and PP lane its
    own max_num_seqs; a prefill engine's count beside its decode engines')."""
    def of(text: str) -> int:
        lay = Layout.parse(text)
        return lay.dp * lay.pp * d.max_num_seqs
    if d.disaggregated:
        return d.decode_replicas * of(d.decode)
    return d.replicas * of(d.layout)


def scaled(d: Deployment) -> tuple[Deployment, int]:
    """(the smaller deployment d is judged by, d's size over its size); (d, 1) when d is judged itself."""
    if d.prefix_caching:
        return d, 1
    if d.disaggregated:
        k = math.gcd(d.prefill_replicas, d.decode_replicas, d.colocated_replicas)
        return (replace(d, prefill_replicas=d.prefill_replicas // k, decode_replicas=d.decode_replicas // k,
                        colocated_replicas=d.colocated_replicas // k), k) if k > 1 else (d, 1)
    if d.replicas > SCALE_TO and d.replicas % SCALE_TO == 0:
        return replace(d, replicas=SCALE_TO), d.replicas // SCALE_TO
    return d, 1


def _scaled(t: Trial | None, factor: int) -> Trial | None:
    """A run of the smaller deployment as the larger one's: the rate and throughputs times factor."""
    if t is None:
        return None
    serve = dict(t.serve)
    for k in ("request_throughput", "output_throughput", "total_token_throughput"):
        if serve.get(k) is not None:
            serve[k] *= factor
    if "goodput" in serve:
        g = dict(serve["goodput"])
        for k in ("request_goodput", "output_token_goodput"):
            if g.get(k) is not None:
                g[k] *= factor
        serve["goodput"] = g
    return Trial(t.rate * factor, serve, t.engines)
