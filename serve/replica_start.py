"""Starting atoll serve's replicas: each its share of this machine (local) or its own Ray job,
side by side, behind one router (serve.replicas.Replicas), and again after a failure."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from atoll.engine.batch.router import RoundRobinRouter, make_router
from atoll.engine.driver.elastic import ElasticEngine
from atoll.engine.driver.living import engine_spec
from atoll.engine.driver.online import OnlineEngine
from atoll.launch.api import LocalLauncher
from atoll.serve.replicas import Replicas
from atoll.serve.restarts import RestartPolicy


class LocalShare:
    """The local launcher for one replica of several on this machine: its ranks get their
    share of the CPU's threads (not each the whole machine's) and GPUs of their own (replica
    k's ranks start at GPU k x ranks)."""

    def __init__(self, base, *, threads: int, first_gpu: int):
        self.base, self.threads, self.first_gpu = base, threads, first_gpu
        self.channel = base.channel
        self.elastic = getattr(base, "elastic", False)  # --elastic-ep runs under it as under its base

    def start(self, fn, world_size: int, *args, **kwargs):
        return self.base.start(fn, world_size, *args, threads=self.threads, first_gpu=self.first_gpu, **kwargs)


def replica_launchers(launcher, count: int, world_size: int) -> list:
    """One launcher per replica: shares of this machine under the local launcher; the same
    launcher for all under Ray (each replica's job reserves its own actors)."""
    if not isinstance(launcher, LocalLauncher):
        return [launcher] * count
    threads = max(1, (os.cpu_count() or 1) // (world_size * count))
    return [LocalShare(launcher, threads=threads, first_gpu=k * world_size) for k in range(count)]


def start_single(llm, *, parallel=None, policy: RestartPolicy | None = None) -> Replicas:
    """One engine that comes back: its ranks started again on the same resources when one
    dies, under `policy`, its requests held meanwhile and continued there with their tokens
    (a set of one replica, named after the engine's layout in its lines). Under --elastic-ep
    the engine first goes on without a lost rank by itself; it is started again, at its whole
    layout, only when it cannot (its last rank lost, an expert with no source left, a rank
    that failed with an error of its own)."""
    elastic = llm.options.elastic_ep
    return start_replicas(llm, 1, parallel=parallel, router="round_robin", policy=policy,
                          label=f"{'elastic ' if elastic else ''}engine {llm.layout}",
                          kind=ElasticEngine if elastic else OnlineEngine)


def start_disagg(llm, *, policy: RestartPolicy | None = None) -> Replicas:
    """A disaggregated job that comes back: when a rank of its prefill or a decode engine dies,
    the whole job (every engine) is started again on the same resources under `policy`, its
    requests held meanwhile and continued there with their tokens (a set of one replica)."""
    from atoll.engine.driver.disagg import DisaggEngine, disagg_job  # lazy: as llm.start does

    def one(k: int) -> DisaggEngine:
        o = llm.options
        engine = DisaggEngine(disagg_job(llm), launcher=llm.launcher, min_prompt_tokens=o.disagg_min_prompt_tokens,
                              max_prefill_queue=o.disagg_max_prefill_queue)
        engine.heals = True  # an engine's failure fails the job: this set restarts it (disagg_faults)
        return engine

    return Replicas([one(0)], RoundRobinRouter(), start=one, policy=policy,
                    label=f"disaggregated engine {llm.prefill_layout}P+{llm.layout}D")


def start_replicas(llm, count: int, *, parallel=None, router: str = "cache_aware",
                   policy: RestartPolicy | None = None, label: str | None = None,
                   traces: str | None = None, kind=OnlineEngine) -> Replicas:
    """`count` living engines of llm's layout, started side by side, behind a router. A
    replica that fails to start stops the others and its error is raised; one that dies
    later is started again under `policy` (serve.restarts). label: see Replicas. traces: a
    directory where replica k writes its step trace, replica{k}.jsonl (serve.predict reads it)."""
    spec = engine_spec(llm)
    launchers = replica_launchers(llm.launcher, count, llm.layout.world_size)
    chooser: list = []  # the router, once the engines said their sizes; their cache events go to it

    def events_of(k: int):
        return lambda events: chooser[0].observe(k, events) if chooser else None

    def spec_of(k: int):
        own = spec if label else spec.for_engine(f"replica{k}")
        return own.with_engine(step_trace=os.path.join(traces, f"replica{k}.jsonl")) if traces else own

    def one(k: int) -> OnlineEngine:
        return kind(spec_of(k), world_size=llm.layout.world_size, launcher=launchers[k],
                            parallel=parallel or llm.context_options(),
                            on_events=events_of(k) if router == "cache_aware" else None)

    # under Ray the first alone: its job may start the Ray session the others then join
    alone = 0 if isinstance(llm.launcher, LocalLauncher) else 1
    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(one, k) for k in range(alone)]
        if alone:
            futures[0].exception()  # wait for it
        futures += [pool.submit(one, k) for k in range(alone, count)]
    engines, failure = [], None
    for f in futures:
        try:
            engines.append(f.result())
        except BaseException as e:  # noqa: BLE001 - the first failure is raised once the rest are stopped
            failure = failure or e
    if failure is not None:
        for engine in reversed(engines):
            engine.close()
        raise failure
    info = engines[0].info
    capacities = [e.info["num_blocks"] for e in engines]
    chooser.append(make_router(router, capacities=capacities, block_size=info["block_size"],
                               imbalance=max(1, info["max_num_seqs"] // 4), events=True,
                               tiers=[bool(e.info.get("kv_tiers")) for e in engines]))
    return Replicas(engines, chooser[0], start=one, policy=policy, label=label)
