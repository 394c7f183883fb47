"""simulate(): a deployment under a load, through the simulator (see the package's docstring)."""


from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from atoll.errors import ConfigError
from atoll.models.config import ModelConfig
from atoll.models.presets import resolve_model
from atoll.parallel.layout import Layout
from atoll.planner.sim.deploy import Deployment, engine_kind
from atoll.planner.sim.report import PERCENTILES, report, summarize, tier_report
from atoll.planner.sim.run import Simulation
from atoll.planner.shapes import shapes as model_shapes

MAX_REQUESTS = 10_000_000


def simulate(model, topology, deployment: Deployment, requests: list, *, rate: float = math.inf,
             burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
             slos: dict | None = None, percentiles=PERCENTILES, progress=None, model_name: str | None = None) -> dict:
    """Every request through the deployment on `topology`: {"serve": bench serve's report,
    "engines": each engine's figures, "routed": how the requests were routed, "deployment",
    "sim_wall_s": the simulation's own seconds}. requests: load.BenchRequest with token-id
    prompts. progress(n): called as requests end. model_name: the name the calibration's
    measured steps go by (a checkpoint dir's name; default the preset's or dir's)."""
    t0 = time.perf_counter()
    prepared = prepare(model, topology, deployment, requests, model_name=model_name)
    out = prepared.run(requests, rate=rate, burstiness=burstiness, max_concurrency=max_concurrency, seed=seed,
                       slos=slos, percentiles=percentiles, progress=progress)
    out["sim_wall_s"] = time.perf_counter() - t0
    return out


@dataclass
class Prepared:
    """A deployment ready to simulate: its engines' kinds (cost models, KV capacity), built once
    for any number of runs (an SLO search runs one deployment at several rates)."""
    deployment: Deployment
    topology: object
    kinds: list
    gpus: int
    kv_bytes_per_token: float
    memos: dict = field(default_factory=dict)  # the steps costed so far, shared by the runs

    @property
    def steps_from(self) -> str:
        return "measured engine steps" if all(k.fit for k in self.kinds) else "the cost model"

    def run(self, requests: list, *, rate: float = math.inf, burstiness: float = 1.0,
            max_concurrency: int | None = None, seed: int = 0, slos: dict | None = None,
            percentiles=PERCENTILES, progress=None, fast: bool = True) -> dict:
        """simulate()'s figures for these requests (they should be like the ones prepared for);
        fast False: every tick stepped, none fast-forwarded (steady.py)."""
        check_requests(requests, max_concurrency)
        t0 = time.perf_counter()
        sim = Simulation(self.deployment, self.kinds, requests, topology=self.topology,
                         kv_bytes_per_token=self.kv_bytes_per_token, rate=rate, burstiness=burstiness,
                         max_concurrency=max_concurrency, seed=seed, progress=progress, memos=self.memos,
                         fast=fast)
        results, duration = sim.run()
        engines = sim.engine_figures(duration)
        out = {"deployment": self.deployment.describe(), "topology": self.topology.name, "gpus": self.gpus,
               "steps_from": self.steps_from, "serve": report(results, duration, slos=slos, percentiles=percentiles),
               "engines": engines, "routed": dict(sim.routed),
               "kv_capacity": [{"layout": str(k.layout), "tokens": k.capacity.tokens(),
                                "describe": k.capacity.describe()} for k in self.kinds if k.capacity is not None]}
        if self.deployment.tiered:
            sent = sum(len(c.prompt) for c in sim.clients if c.start is not None)
            out["kv_tiers"] = tier_report(sim.tier_counts(), prompt_tokens=sent,
                                          prompt_computed=sum(e["prompt_tokens_computed"] for e in engines),
                                          block_size=self.deployment.block_size)
        if any(r.after is not None for r in requests):  # conversations: their first and later turns apart
            ttft = {"first": [], "later": []}
            for r, q in zip(results, requests):
                if r.success:
                    ttft["first" if q.after is None else "later"].append(r.ttft)
            out["turns_ttft_ms"] = {k: summarize(v, percentiles) for k, v in ttft.items()}
        if slos and out["serve"]["goodput"]["request_goodput"] is not None:
            out["goodput_per_gpu"] = out["serve"]["goodput"]["request_goodput"] / self.gpus
        out["sim_wall_s"] = time.perf_counter() - t0
        return out


def check_requests(requests: list, max_concurrency: int | None = None) -> None:
    if not requests:
        raise ConfigError("nothing to simulate: no requests")
    if len(requests) > MAX_REQUESTS:
        raise ConfigError(f"{len(requests)} requests: the simulator takes at most {MAX_REQUESTS}")
    if any(not isinstance(r.prompt, list) for r in requests):
        raise ConfigError("the simulator takes token-id prompts: tokenize text prompts first")
    for i, r in enumerate(requests):  # a later turn follows an earlier request (load.multi_turn_requests)
        if r.after is not None and (isinstance(r.after, bool) or not isinstance(r.after, int) or not 0 <= r.after < i):
            raise ConfigError(f"request {i}: after={r.after!r} must be the index of an earlier request")
    if max_concurrency is not None and (isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int)
                                        or max_concurrency < 1):
        raise ConfigError(f"max_concurrency={max_concurrency!r} must be a whole number of at least 1")


def prepare(model, topology, deployment: Deployment, requests: list, *, model_name: str | None = None) -> Prepared:
    """The deployment's engines for requests like these (their mean lengths size the cost model's
    workload and the KV capacity); model: a ModelConfig, a preset or a config path."""
    check_requests(requests)
    if isinstance(model, ModelConfig):
        config = model
    else:
        name, config = resolve_model(str(model))
        model_name = model_name or name
    isl = sum(len(r.prompt) for r in requests) / len(requests)
    osl = sum(r.output_len for r in requests) / len(requests)
    d = deployment
    if d.disaggregated:
        gpus = d.prefill_replicas * _world(d.prefill) + d.decode_replicas * _world(d.decode)
        layouts = [d.prefill, d.decode]
    else:
        gpus = d.replicas * _world(d.layout)
        layouts = [d.layout]
    if gpus > topology.num_gpus:
        raise ConfigError(f"{d.describe()} takes {gpus} GPUs; {topology.name} has {topology.num_gpus}")
    kinds = [engine_kind(config, topology, d, lay, isl=isl, osl=osl, ranks=gpus, model_name=model_name)
             for lay in layouts]
    work = kinds[-1].cost_model.w
    kv_token = model_shapes(config).kv_bytes_per_token_layer(1, work.kv_bytes, work.kv_scale_bytes) \
        * config.num_hidden_layers
    return Prepared(d, topology, kinds, gpus, kv_token)


def _world(text: str) -> int:
    return Layout.parse(text).world_size


__all__ = ["Deployment", "Prepared", "prepare", "simulate"]
