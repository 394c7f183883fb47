"""OnlineEngine: the driver's side of a living engine. Its ranks are started once through a
launcher's `start` and run the rank loop (engine/worker.py, engine/rank/loop.py) until `close()`; requests are submitted at
any time and stream their tokens back as the ranks take them.

    engine = OnlineEngine(spec, world_size=2, launcher=LocalLauncher())
    engine.submit(Request(engine.new_id(), ids, params), sink)   # sink(kind, payload), kind:
    engine.abort(index)                                          #   "token": (token id, logprobs,
    engine.close()                                               #     prompt logprobs),
                                                                 #   "finish": the result dict,
                                                                 #   "error": a line naming the cause
logprobs is None unless the request asked for them (SamplingParams.logprobs): then
{"logprob": float, "top": [(token id, logprob), ...]}; prompt logprobs come with a request's
first token when it asked for them (SamplingParams.prompt_logprobs), else None.

A pump thread reads what rank 0 sends and calls each request's sink from that thread, and
watches the job: a rank that raises or dies ends every request still running with an error
naming it, and `error` says so from then on (the engine is dead; `healthy` is False).
Requests go to the DP replica with the fewest unfinished requests (a request's copies, n > 1, to
its first copy's).
"""

from __future__ import annotations

import itertools
import queue
import sys
import threading
import time
import traceback
from collections import deque

from atoll.engine.batch.request import Request
from atoll.engine.rank.job import EngineJob
from atoll.engine.rank.run_spec import RunSpec
from atoll.engine.worker import worker
from atoll.errors import AtollError, LaunchError


class EngineDead(AtollError):
    """The engine's ranks failed; the line names the rank and the cause."""


class OnlineEngine:
    def __init__(self, spec: RunSpec, *, world_size: int, launcher, parallel=None, ready_timeout_s: float = 900,
                 link_stats: bool = False, on_events=None):
        """on_events(events): the blocks the engine's pools named (True, name) or evicted
        (False, name) since its last step report (asked of the ranks only when given)."""
        self.spec, self.link_stats, self.on_events = spec, link_stats, on_events
        self.links = None  # with link_stats: the run's bytes by link class, once closed (parallel.links)
        self._inbox, self._outbox = launcher.channel(), launcher.channel()
        self.job = self._start(launcher, world_size, parallel)
        if hasattr(self.job, "stall_s"):  # the local launcher's heartbeat threshold
            self.job.stall_s = spec.engine.heartbeat_timeout_s
        # seconds between the step reports that came while requests ran (serve.drain's outliers)
        self.step_gaps: deque = deque(maxlen=spec.engine.slow_step_window)
        self._last_step: float | None = None
        self._lock = threading.Lock()
        self._sinks: dict[int, object] = {}
        self._replica: dict[int, int] = {}
        self._ids = itertools.count()
        self.error: str | None = None
        self.stats: dict = {}
        self._closing = False
        try:
            self.info = self._wait_ready(ready_timeout_s)
        except BaseException:
            self.job.stop()
            raise
        self._load = [0] * self.info["replicas"]
        self._ready()
        self._thread = threading.Thread(target=self._pump, daemon=True, name="atoll-engine")
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.error is None and not self._closing

    def new_id(self) -> int:
        return next(self._ids)

    def _start(self, launcher, world_size: int, parallel):
        """The ranks' job (a subclass runs other workers)."""
        job = EngineJob.colocated(self.spec, parallel, link_stats=self.link_stats,
                                  cache_events=self.on_events is not None)
        return launcher.start(worker, world_size, job, [self._inbox], self._outbox, device=self.spec.engine.device)

    def _ready(self) -> None:
        """Once the ranks are ready, before the pump starts (a subclass sets up its state)."""

    def _handle(self, msg) -> None:
        """One message from the ranks other than "step" (a subclass has more)."""

    def _describe(self, e: AtollError) -> str:
        """The line a failure of the job ends every request with."""
        return str(e)

    def _survive(self, e: AtollError) -> bool:
        """Whether the engine goes on after this failure of some of its ranks (a subclass whose
        job holds engines that can fail alone); False: every request ends with the error."""
        return False

    def _take_stats(self, stats: dict, engine: str | None) -> None:
        events = stats.pop("kv_events", None)
        if events and self.on_events is not None:
            self.on_events([(named, name) for _, named, name in events])
        self.stats = stats

    def _stop_ranks(self) -> None:
        self._inbox.put(("stop",))

    @property
    def _stopped(self) -> bool:
        """While closing: whether every rank has been told to stop and nothing more comes."""
        return True

    def submit(self, request: Request, sink) -> None:
        """Queue `request` (its index from new_id) for the ranks; `sink` gets its events."""
        with self._lock:
            replica = self._take(request, sink)
        self._inbox.put(("add", request, replica))

    def submit_all(self, pairs: list) -> None:
        """Queue every (request, sink) of `pairs` as one message: they join the batch at one
        tick, as a fixed list does, so a run's batches do not hang on how fast it was sent."""
        with self._lock:
            adds = [("add", request, self._take(request, sink)) for request, sink in pairs]
        self._inbox.put(("adds", adds))

    def _take(self, request: Request, sink) -> int:
        """Under the lock: refuse when dead or closing, else hold the request's sink and give
        it the replica with the fewest unfinished requests (its index)."""
        if self.error is not None:
            raise EngineDead(self.error)
        if self._closing:
            raise EngineDead("the engine is shutting down")
        replica = self._least_loaded()
        if request.fork_of in self._replica:  # a copy (n > 1) goes where its leader went, to fork from it
            replica = self._replica[request.fork_of]
        self._load[replica] += 1
        self._sinks[request.index], self._replica[request.index] = sink, replica
        return replica

    def _least_loaded(self) -> int:
        """Under the lock: the replica with the fewest unfinished requests."""
        return self._load.index(min(self._load))

    def abort(self, index: int) -> None:
        """End a running request; its sink gets "finish" with finish_reason "abort"."""
        with self._lock:
            if index not in self._sinks:
                return
        self._inbox.put(("abort", index))

    def unfinished(self) -> int:
        with self._lock:
            return len(self._sinks)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the ranks (requests still running end with an error) and wait for them."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        try:
            self._stop_ranks()
        except (OSError, ValueError):  # the queue is already gone
            pass
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
        try:
            if self.error is None:
                self.job.wait(timeout_s)
                self._last_words()
        except AtollError:
            pass
        finally:
            self.job.stop()
            self._fail("the engine was shut down")

    def _last_words(self, timeout_s: float = 10.0) -> None:
        """What rank 0 sent as it stopped, after the pump ended: the link totals, when counted.
        Its value can reach the launcher before its last message reaches this channel (each
        has its own feeder), so a clean stop waits for them."""
        deadline = time.monotonic() + timeout_s
        while self.link_stats and self.links is None and time.monotonic() < deadline:
            try:
                msg = self._outbox.get(timeout=0.05)
            except queue.Empty:
                continue
            except (OSError, EOFError, ValueError):
                return
            if msg[0] == "links":
                self.links = msg[1]

    _engines = 1  # "ready" messages to wait for: one per engine in the job

    def _wait_ready(self, timeout_s: float) -> dict:
        """The last engine's "ready" info (a disaggregated job's decode engine)."""
        deadline = time.monotonic() + timeout_s
        infos = []
        while True:
            self.job.check(wait_s=0.05)  # a rank that failed while loading raises here
            try:
                msg = self._outbox.get_nowait()
            except queue.Empty:
                msg = None
            if msg is not None and msg[0] == "ready":
                infos.append(msg[1])
                if len(infos) == self._engines:
                    return next((i for i in infos if not (i.get("engine") or "").startswith("prefill")), infos[-1])
            if time.monotonic() > deadline:
                raise LaunchError(f"the engine's ranks were not ready within {timeout_s:.0f} s")

    def _stalled(self, last: float) -> bool:
        """Requests run but no step came for the config's stall_timeout_s (a slow or stopped rank)."""
        limit = self.spec.engine.stall_timeout_s
        if limit is None or time.monotonic() - last < limit:
            return False
        with self._lock:
            running = len(self._sinks)
        if running:
            self._fail(f"the ranks sent no step for {limit:g} s while {running} requests ran (--stall-timeout-s): "
                       "a rank is slow or stopped")
        return bool(running)

    def _pump(self) -> None:
        try:
            self._pump_messages()
        except Exception as e:  # the driver's own fault: every request ends with its line, none waits on
            traceback.print_exc(file=sys.stderr)
            self._fail(f"the engine's driver failed: {type(e).__name__}: {' '.join(str(e).split())}")

    def _pump_messages(self) -> None:
        last = time.monotonic()  # the latest message, or the latest time nothing ran
        while True:
            try:
                msg = self._outbox.get(timeout=0.1)
            except queue.Empty:
                msg = None
            except (OSError, EOFError, ValueError):
                msg = None
            if msg is not None or not self._sinks:
                last = time.monotonic()
            elif not self._closing and self._stalled(last):
                return
            if msg is not None:
                if msg[0] == "step":
                    now = time.monotonic()
                    self._deliver(msg[1], msg[2], msg[3], msg[4] if len(msg) > 4 else None)
                    self._time_step(now)
                elif msg[0] == "links":
                    self.links = msg[1]
                else:
                    self._handle(msg)
            if self._closing and msg is None and self._stopped:
                return
            if not self._closing:
                try:
                    self.job.check()
                except AtollError as e:
                    if self._survive(e):
                        continue
                    self._fail(self._describe(e))
                    return

    def _deliver(self, tokens, finished, stats, engine: str | None = None) -> None:
        with self._lock:
            sinks = dict(self._sinks)
            for index, _ in finished:
                self._sinks.pop(index, None)
                replica = self._replica.pop(index, None)
                if replica is not None:
                    self._load[replica] -= 1
            if stats is not None:
                self._take_stats(stats, engine)
        for index, token, *logprobs in tokens:
            sink = sinks.get(index)
            if sink is not None:
                sink("token", (token, *logprobs[:2], *[None] * (2 - len(logprobs))))
        for index, result in finished:
            sink = sinks.get(index)
            if sink is not None:
                sink("finish", result)

    def _time_step(self, now: float) -> None:
        """A step report came at `now`: its gap since the last one counts if requests ran between."""
        if self._last_step is not None:
            self.step_gaps.append(now - self._last_step)
        self._last_step = now if self._sinks else None

    def _fail(self, line: str) -> None:
        with self._lock:
            if self.error is None:
                self.error = line
            sinks, self._sinks = self._sinks, {}
            self._replica.clear()
            self._load = [0] * len(self._load) if hasattr(self, "_load") else []
        for sink in sinks.values():
            sink("error", line)
