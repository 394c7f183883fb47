"""Replicas: N living engines of one layout behind a router, seen by the server as one engine
(the same submit / abort / new_id / error / stats as engine.driver.online.OnlineEngine).

Each request goes to the replica the router picks (engine.batch.router). A replica whose ranks die
fails only the requests it holds, each error naming the replica and the rank; a request that
has streamed no token yet is sent again to another live replica instead (the client sees a
longer first-token time, no error). The others keep serving: `degraded` names the dead ones
(/health says so), and `error` is set only once every replica is dead, so the server then
stops as it does for a single engine.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import Counter, Gauge

from atoll.engine.driver.living import engine_spec
from atoll.engine.driver.online import EngineDead, OnlineEngine
from atoll.launch.api import LocalLauncher
from atoll.engine.batch.router import Route, make_router

PREFIX = "atoll_router"


class _Placed:
    """One request's replica, and whether the client has seen a token of it."""

    __slots__ = ("request", "sink", "replica", "streamed", "aborted", "names")

    def __init__(self, request, sink, replica: int):
        self.request, self.sink, self.replica = request, sink, replica
        self.streamed = self.aborted = False
        self.names: tuple = ()  # its prompt's block names, as the router routed it


class Replicas:
    def __init__(self, engines: list[OnlineEngine], router):
        self.engines, self.router = engines, router
        self._lock = threading.RLock()
        self._ids = iter(range(1 << 62))
        self._placed: dict[int, _Placed] = {}
        self._load = [0] * len(engines)
        self._dead: dict[int, str] = {}
        self._closing = False
        self.metrics = None
        self._routed_prompt = self._routed_hit = 0  # tokens, for the router's hit rate

    # --- what the server reads -------------------------------------------------------------

    @property
    def error(self) -> str | None:
        """Set once every replica is dead: the server stops."""
        self._watch()
        return self._all_dead()

    def _all_dead(self) -> str | None:
        if len(self._dead) < len(self.engines):
            return None
        return "every replica failed: " + "; ".join(f"replica {r}: {line}" for r, line in sorted(self._dead.items()))

    @property
    def degraded(self) -> dict[int, str]:
        """replica -> why it is dead, for the replicas that are."""
        self._watch()
        return dict(self._dead)

    @property
    def healthy(self) -> bool:
        return self.error is None and not self._closing

    @property
    def stats(self) -> dict:
        """The live replicas' counters added up."""
        out: dict = {}
        for r, engine in enumerate(self.engines):
            if r not in self._dead:
                for k, v in engine.stats.items():
                    out[k] = out.get(k, 0) + v
        return out

    @property
    def info(self) -> dict:
        return self.engines[0].info

    def unfinished(self) -> int:
        with self._lock:
            return len(self._placed)

    def new_id(self) -> int:
        with self._lock:
            return next(self._ids)

    # --- requests --------------------------------------------------------------------------

    def submit(self, request, sink) -> None:
        """Route the request and queue it on its replica; EngineDead when none is alive."""
        placed = _Placed(request, sink, -1)
        self._place(placed, retry=False)

    def abort(self, index: int) -> None:
        with self._lock:
            placed = self._placed.get(index)
            if placed is None:
                return
            placed.aborted = True
            engine = self.engines[placed.replica]
        engine.abort(index)

    def submit_all(self, pairs: list) -> None:
        """Route every (request, sink) and queue each replica's share as one message, so a
        request's copies (n > 1) join their replica at one tick and fork there; a replica found
        dead meanwhile has its share routed again, one by one."""
        groups: dict[int, list] = {}
        for request, sink in pairs:
            placed = _Placed(request, sink, -1)
            groups.setdefault(self._route(placed, retry=False).replica, []).append(placed)
        for replica, group in groups.items():
            try:
                self.engines[replica].submit_all([(p.request, self._sink(p, replica)) for p in group])
            except EngineDead as e:
                for placed in group:
                    self._unroute(placed)
                self._mark_dead(replica, str(e))
                for placed in group:
                    self._place(placed, retry=False)

    def _place(self, placed: _Placed, *, retry: bool, exclude: int | None = None) -> None:
        while True:
            route = self._route(placed, retry=retry, exclude=exclude)
            try:
                self.engines[route.replica].submit(placed.request, self._sink(placed, route.replica))
                return
            except EngineDead as e:  # it died since it was last looked at: mark it, route again
                self._unroute(placed)
                self._mark_dead(route.replica, str(e))

    def _route(self, placed: _Placed, *, retry: bool, exclude: int | None = None):
        """Choose the request's replica (a copy of a request, n > 1, its first copy's) and count it."""
        with self._lock:
            if self._closing:
                raise EngineDead("the server is shutting down")
            alive = [r for r in range(len(self.engines)) if r not in self._dead and r != exclude]
            if not alive:
                raise EngineDead(self._all_dead() or "no other replica is alive")
            lead = self._placed.get(placed.request.fork_of)
            if lead is not None and lead.replica in alive:  # a copy forks where its first copy runs
                route = Route(lead.replica, "copy", len(placed.request.prompt_token_ids))
            else:
                route = self.router.choose(placed.request.prompt_token_ids, self._load, alive)
            placed.replica, placed.names = route.replica, route.names
            self._load[route.replica] += 1
            self._placed[placed.request.index] = placed
            self._count(route, len(placed.request.prompt_token_ids), retry=retry)
            return route

    def _unroute(self, placed: _Placed) -> None:
        """Take back a routing whose replica turned out dead."""
        with self._lock:
            self._load[placed.replica] -= 1
            self.router.settle(placed.replica, placed.names)
            self._placed.pop(placed.request.index, None)

    def _sink(self, placed: _Placed, replica: int):
        def sink(kind: str, payload) -> None:  # the replica's pump thread
            if kind == "token":
                placed.streamed = True
                placed.sink(kind, payload)
                return
            with self._lock:
                self._load[replica] -= 1
                self.router.settle(replica, placed.names)
                if self._placed.get(placed.request.index) is placed:
                    del self._placed[placed.request.index]
            if kind == "error":
                self._mark_dead(replica, payload)
                if not placed.streamed and not placed.aborted and not self._closing:
                    try:
                        self._place(placed, retry=True, exclude=replica)
                        return
                    except EngineDead:
                        pass
                payload = f"replica {replica}: {payload}"
            placed.sink(kind, payload)
        return sink

    # --- faults ----------------------------------------------------------------------------

    def _watch(self) -> None:
        """Mark the replicas whose engines report an error (a rank died, nothing in flight)."""
        for r, engine in enumerate(self.engines):
            if engine.error is not None and r not in self._dead:
                self._mark_dead(r, engine.error)

    def _mark_dead(self, replica: int, line: str) -> None:
        with self._lock:
            if replica in self._dead or self._closing:
                return
            self._dead[replica] = line
            self.router.forget(replica)
        if self.metrics is not None:
            self.metrics["up"].labels(str(replica)).set(0)

    # --- metrics ---------------------------------------------------------------------------

    def attach_metrics(self, registry) -> None:
        """The router's counters in the server's registry (serve.metrics.Metrics)."""
        m = self.metrics = {
            "routed": Counter(f"{PREFIX}_requests", "requests sent to a replica, by replica and reason (prefix: "
                              "the longest cached prefix; least_loaded: no replica held one; balance: the best "
                              "one was a batch busier than the least loaded; round_robin; copy: a copy of a request, n > 1, "
                              "to its first copy's replica; a retry counts again)",
                              ["replica", "reason"], registry=registry),
            "retried": Counter(f"{PREFIX}_retries", "requests sent again to another replica because theirs died "
                               "before their first token", registry=registry),
            "prompt": Counter(f"{PREFIX}_prompt_tokens", "prompt tokens of the requests routed", registry=registry),
            "hit": Counter(f"{PREFIX}_prefix_hit_tokens", "of those, the tokens the router expected the chosen "
                           "replica to hold in its prefix cache", registry=registry),
            "up": Gauge(f"{PREFIX}_replica_up", "1 while the replica serves, 0 once its ranks died", ["replica"],
                        registry=registry),
        }
        Gauge(f"{PREFIX}_prefix_hit_rate", "router's expected prefix hits / prompt tokens routed, since start",
              registry=registry).set_function(lambda: self._routed_hit / max(1, self._routed_prompt))
        for r in range(len(self.engines)):
            m["up"].labels(str(r)).set(0 if r in self._dead else 1)

    def _count(self, route, prompt_tokens: int, *, retry: bool) -> None:
        self._routed_prompt += prompt_tokens
        self._routed_hit += route.hit_tokens
        m = self.metrics
        if m is None:
            return
        m["routed"].labels(str(route.replica), route.reason).inc()
        m["prompt"].inc(prompt_tokens)
        m["hit"].inc(route.hit_tokens)
        if retry:
            m["retried"].inc()

    # --- lifetime --------------------------------------------------------------------------

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop every replica's ranks (the last one started first: under Ray the first one's
        job may own the Ray session the others joined)."""
        with self._lock:
            self._closing = True
        for engine in reversed(self.engines):
            engine.close(timeout_s)


class LocalShare:
    """The local launcher for one replica of several on this machine: its ranks get their
    share of the CPU's threads (not each the whole machine's) and GPUs of their own (replica
    k's ranks start at GPU k x ranks)."""

    def __init__(self, base, *, threads: int, first_gpu: int):
        self.base, self.threads, self.first_gpu = base, threads, first_gpu
        self.channel = base.channel

    def start(self, fn, world_size: int, *args, **kwargs):
        return self.base.start(fn, world_size, *args, threads=self.threads, first_gpu=self.first_gpu, **kwargs)


def replica_launchers(launcher, count: int, world_size: int) -> list:
    """One launcher per replica: shares of this machine under the local launcher; the same
    launcher for all under Ray (each replica's job reserves its own actors)."""
    if not isinstance(launcher, LocalLauncher):
        return [launcher] * count
    threads = max(1, (os.cpu_count() or 1) // (world_size * count))
    return [LocalShare(launcher, threads=threads, first_gpu=k * world_size) for k in range(count)]


def start_replicas(llm, count: int, *, parallel=None, router: str = "cache_aware") -> Replicas:
    """`count` living engines of llm's layout, started side by side, behind a router. A
    replica that fails to start stops the others and its error is raised."""
    spec = engine_spec(llm)
    launchers = replica_launchers(llm.launcher, count, llm.layout.world_size)
    chooser: list = []  # the router, once the engines said their sizes; their cache events go to it

    def events_of(k: int):
        return lambda events: chooser[0].observe(k, events) if chooser else None

    def one(k: int) -> OnlineEngine:
        return OnlineEngine(spec.for_engine(f"replica{k}"), world_size=llm.layout.world_size, launcher=launchers[k],
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
    return Replicas(engines, chooser[0])
