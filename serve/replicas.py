"""Replicas: N living engines of one layout behind a router, seen by the server as one engine
(the same submit / abort / new_id / error / stats as engine.driver.online.OnlineEngine).

Each request goes to the replica the router picks (engine.batch.router). When a replica's ranks
die, its requests continue on another live one: one that streamed no token is sent again; one
that did goes on there with its tokens (engine.batch.request's `generated`), its client seeing a
longer gap, no error, nothing repeated or missing. With no replica alive, requests wait for one
that is restarting (serve.restarts), and end with the cause once none will come back.

A dead replica is started again under the RestartPolicy and rejoins the router once ready;
`degraded` names those down (/health), `error` is set once all are down for good. A single
engine that restarts is a set of one. `off`: replicas the admin API took out (serve.admin).
"""

from __future__ import annotations

import sys
import threading
from dataclasses import replace

from prometheus_client import Counter, Gauge

from atoll.engine.driver.online import EngineDead, OnlineEngine
from atoll.engine.batch.router import Route
from atoll.serve.metrics import ROUTER_HELP
from atoll.serve import drain
from atoll.serve.restarts import RestartPolicy, Restarts

PREFIX = "atoll_router"


class _Placed:
    """One request's replica, the tokens its client has seen, and its migrations."""

    __slots__ = ("request", "sink", "replica", "aborted", "names", "tokens", "migrations")

    def __init__(self, request, sink, replica: int):
        self.request, self.sink, self.replica = request, sink, replica
        self.aborted = False
        self.names: tuple = ()  # its prompt's block names, as the router routed it
        self.tokens: list[int] = []  # the tokens streamed to the client, over every replica it ran on
        self.migrations = 0

    def continuation(self):
        """The request to send on: with the tokens streamed so far as its output (no fork: its
        first copy's blocks may be gone with the dead replica)."""
        return replace(self.request, generated=list(self.tokens), fork_of=None)


class Replicas:
    def __init__(self, engines: list[OnlineEngine], router, *, start=None, policy: RestartPolicy | None = None,
                 label: str | None = None):
        """start(k): a new engine for replica k on its resources (a restart); None: never restart.
        label: a single engine's name in its lines, in place of "replica 0" (serve.single)."""
        self.engines, self.router, self.label = engines, router, label
        self._lock = threading.RLock()
        self._ids = iter(range(1 << 62))
        self._placed: dict[int, _Placed] = {}
        self._load = [0] * len(engines)
        self._dead: dict[int, str] = {}
        self._restarting: set[int] = set()
        self._held: list[_Placed] = []  # waiting for a restarting replica: none was alive
        self._start, self.restarts = start, Restarts(policy or RestartPolicy(), len(engines))
        self._closing = False
        self._stop = threading.Event()
        self.metrics = None
        self._routed_prompt = self._routed_hit = 0  # tokens, for the router's hit rate
        self.off: dict[int, str] = {}  # replica -> draining / removing / removed / starting (serve.admin)
        self._threads = drain.start_watches(self, self._stop)  # slow replicas, unfit GPUs (serve.drain)

    @property
    def error(self) -> str | None:
        """Set once every replica is dead: the server stops."""
        self._watch()
        return self._all_dead()

    def _all_dead(self) -> str | None:
        if len(self._dead) < len(self.engines) or self._restarting:
            return None
        if self.label is not None:
            return f"{self.label}: {self._dead[0]}"
        return "every replica failed: " + "; ".join(f"replica {r}: {line}" for r, line in sorted(self._dead.items()))

    def name(self, replica: int) -> str:
        return self.label if self.label is not None else f"replica {replica}"

    @property
    def restarting(self) -> str | None:
        """While no engine serves and one is being started again: why (the last cause)."""
        with self._lock:
            if len(self._dead) < len(self.engines) or not self._restarting:
                return None
            r = min(self._restarting)
            return f"{self.name(r)} is restarting ({self.restarts.count(r)} of at most " \
                   f"{self.restarts.policy.max_restarts} within {self.restarts.policy.window_s:g} s) after: {self._dead[r]}"

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
        """The live replicas' counters added up (one engine's as they are: MoE expert load is no count)."""
        if len(self.engines) == 1:
            return self.engines[0].stats
        out: dict = {}
        for r, engine in enumerate(self.engines):
            if r not in self._dead and self.off.get(r) not in ("removed", "starting"):
                for k, v in engine.stats.items():
                    out[k] = out.get(k, 0) + v
        return out

    @property
    def info(self) -> dict:
        return self.engines[0].info

    def unfinished(self) -> int:
        return len(self._placed)
    def new_id(self) -> int:
        with self._lock:
            return next(self._ids)

    # --- requests --------------------------------------------------------------------------

    def submit(self, request, sink) -> None:
        """Route the request and queue it on its replica; while none is alive but one is
        restarting, hold it for that one; EngineDead when none is alive or coming back."""
        placed = _Placed(request, sink, -1)
        self._place(placed, retry=False, hold=True)

    def abort(self, index: int) -> None:
        with self._lock:
            placed = self._placed.get(index)
            if placed is None:  # held for a restart, perhaps: its reader is gone, so it is too
                self._held = [p for p in self._held if p.request.index != index]
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
            try:
                groups.setdefault(self._route(placed, retry=False).replica, []).append(placed)
            except EngineDead:  # none alive: held for one restarting (or raised)
                self._place(placed, retry=False, hold=True)
        for replica, group in groups.items():
            try:
                self.engines[replica].submit_all([(p.request, self._sink(p, replica)) for p in group])
            except EngineDead as e:
                for placed in group:
                    self._unroute(placed)
                self._mark_dead(replica, str(e))
                for placed in group:
                    self._place(placed, retry=False)

    def _place(self, placed: _Placed, *, retry: bool, exclude: int | None = None, hold: bool = False) -> None:
        while True:
            try:
                route = self._route(placed, retry=retry, exclude=exclude)
            except EngineDead:
                held = self._hold(placed) if retry or hold else False
                if held is None:  # a replica came back meanwhile: route again (the excluded one is new now)
                    exclude = None
                    continue
                if held:
                    return
                raise
            request = placed.continuation() if placed.tokens else placed.request
            try:
                self.engines[route.replica].submit(request, self._sink(placed, route.replica))
                return
            except EngineDead as e:  # it died since it was last looked at: mark it, route again
                self._unroute(placed)
                self._mark_dead(route.replica, str(e))

    def _hold(self, placed: _Placed) -> bool | None:
        """Hold a request for a restarting replica (True); False if none is; None if one is alive (route it)."""
        with self._lock:
            if self._closing:
                return False
            if len(self._dead) < len(self.engines):
                return None
            if not self._restarting:
                return False
            self._held.append(placed)
            return True

    def _route(self, placed: _Placed, *, retry: bool, exclude: int | None = None):
        """Choose the request's replica (a copy of a request, n > 1, its first copy's) and count it."""
        with self._lock:
            if self._closing:
                raise EngineDead("the server is shutting down")
            alive = [r for r in range(len(self.engines)) if r not in self._dead and r not in self.off and r != exclude]
            if not alive:
                restarting = f" (replica {min(self._restarting)} is restarting)" if self._restarting else ""
                raise EngineDead(self._all_dead() or f"no other replica is alive{restarting}")
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
        engine = self.engines[replica]  # an error from it says nothing of the replica's next engine
        def sink(kind: str, payload) -> None:  # the replica's pump thread
            if kind == "token":
                placed.tokens.append(payload[0])
                if placed.migrations and len(payload) > 2 and payload[2] is not None:
                    payload = (*payload[:2], None, *payload[3:])  # its prompt's logprobs went out already
                placed.sink(kind, payload)
                return
            with self._lock:
                self._load[replica] -= 1
                self.router.settle(replica, placed.names)
                if self._placed.get(placed.request.index) is placed:
                    del self._placed[placed.request.index]
            if kind == "error":
                self._mark_dead(replica, payload, engine)
                if not placed.aborted and not self._closing:
                    try:
                        if placed.tokens:
                            placed.migrations += 1
                            if self.metrics is not None:
                                self.metrics["migrated"].inc()
                        self._place(placed, retry=True, exclude=replica)
                        return
                    except EngineDead:
                        pass
                payload = f"{self.name(replica)}: {self._dead.get(replica, payload)}"  # a crash loop says so
            elif kind == "finish" and placed.migrations:
                payload = {**payload, "metrics": {**payload.get("metrics", {}), "migrations": placed.migrations}}
            placed.sink(kind, payload)
        return sink

    # --- faults ----------------------------------------------------------------------------

    def _watch(self) -> None:
        """Mark the replicas whose engines report an error (a rank died, nothing in flight)."""
        for r, engine in enumerate(self.engines):
            if engine.error is not None and r not in self._dead:
                self._mark_dead(r, engine.error, engine)

    def _mark_dead(self, replica: int, line: str, engine=None) -> None:
        with self._lock:
            if replica in self._dead or self._closing or self.off.get(replica) in ("removed", "starting"):
                return  # closed on purpose (serve.admin), not failed
            if engine is not None and engine is not self.engines[replica]:
                return  # an error from a replica's old engine, not its restarted one
            self._dead[replica] = line
            self.router.forget(replica)
        drain.note_down(self, replica, line)
        self._restart(replica, line)

    def _restart(self, replica: int, line: str) -> None:
        """Start the replica again after its backoff, in a thread, if the policy allows."""
        if self._start is None or self._closing:
            return
        backoff = self.restarts.next_backoff(replica)
        with self._lock:
            if backoff is not None:
                self._restarting.add(replica)
            elif self.restarts.policy.restarts:
                p = self.restarts.policy
                loop = f"crash loop: {p.max_restarts} restarts within {p.window_s:g} s"
                self._dead[replica] = f"{line} ({loop}; it stays down)" if self.label is None else \
                    f"{loop}; last cause: {line}"
            held, self._held = (self._held, []) if not self._restarting else ([], self._held)
        for placed in held:  # nothing will come back for them
            placed.sink("error", f"{self.name(replica)}: {line}")
        if backoff is None:
            return
        thread = threading.Thread(target=self._come_back, args=(replica, backoff), daemon=True,
                                  name=f"atoll-restart-replica{replica}")
        self._threads.append(thread)
        thread.start()

    def _come_back(self, replica: int, backoff: float) -> None:
        if self._stop.wait(backoff):
            return
        try:
            self.engines[replica].close(timeout_s=10.0)  # what is left of its ranks
        except Exception:  # noqa: BLE001 - a dead engine's close may fail; the new one is what counts
            pass
        try:
            engine = self._start(replica)
        except BaseException as e:  # noqa: BLE001 - the restart failed: count it, maybe try again
            with self._lock:
                self._restarting.discard(replica)
                self._dead[replica] = f"restart failed: {e}"
            self._restart(replica, f"restart failed: {e}")
            return
        with self._lock:
            if self._closing:
                closing = True
            else:
                closing = False
                self.engines[replica] = engine
                self._load[replica] = 0
                self._dead.pop(replica, None)
                self._restarting.discard(replica)
                held, self._held = self._held, []
        if closing:
            engine.close()
            return
        print(f"atoll: {self.name(replica)} is back (restart {self.restarts.count(replica)})", file=sys.stderr, flush=True)
        if self.metrics is not None:
            self.metrics["up"].labels(str(replica)).set(1)
            self.metrics["restarts"].labels(str(replica)).inc()
        for placed in held:
            try:
                self._place(placed, retry=True)
            except EngineDead as e:
                placed.sink("error", str(e))

    def state(self, r: int) -> tuple[str, int]:
        """Replica r's state (serving, restarting, dead or its `off` state) and its unfinished requests."""
        with self._lock:
            dead = "restarting" if r in self._restarting else "dead" if r in self._dead else "serving"
            return self.off.get(r, dead), self._load[r]

    def bring_back(self, r: int) -> None:
        """Start replica r again on its resources, in this thread, and route to it (serve.admin's add)."""
        engine = self._start(r)
        with self._lock:
            self.engines[r], self._load[r] = engine, 0
            self.off.pop(r, None)
            self.router.forget(r)
        if self.metrics is not None:
            self.metrics["up"].labels(str(r)).set(1)

    # --- metrics ---------------------------------------------------------------------------

    def attach_metrics(self, registry) -> None:
        """The router's counters in the server's registry (serve.metrics.Metrics)."""
        h = ROUTER_HELP
        m = self.metrics = {
            "routed": Counter(f"{PREFIX}_requests", h["requests"], ["replica", "reason"], registry=registry),
            "retried": Counter(f"{PREFIX}_retries", h["retries"], registry=registry),
            "prompt": Counter(f"{PREFIX}_prompt_tokens", h["prompt_tokens"], registry=registry),
            "hit": Counter(f"{PREFIX}_prefix_hit_tokens", h["prefix_hit_tokens"], registry=registry),
            "up": Gauge(f"{PREFIX}_replica_up", h["replica_up"], ["replica"], registry=registry),
            "migrated": Counter(f"{PREFIX}_migrations", h["migrations"], registry=registry),
            "restarts": Counter(f"{PREFIX}_replica_restarts", h["replica_restarts"], ["replica"], registry=registry),
            "drains": drain.drains_counter(registry),
        }
        Gauge(f"{PREFIX}_prefix_hit_rate", h["prefix_hit_rate"], registry=registry).set_function(
            lambda: self._routed_hit / max(1, self._routed_prompt))
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
        """Stop every replica's ranks, the last started first (under Ray the first's job may own the session)."""
        with self._lock:
            self._closing = True
            held, self._held = self._held, []
        self._stop.set()
        for placed in held:
            placed.sink("error", "the server is shutting down")
        for thread in self._threads:
            thread.join(timeout=timeout_s)
        for engine in reversed(self.engines):
            engine.close(timeout_s)
