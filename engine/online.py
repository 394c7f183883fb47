"""OnlineEngine: the driver's side of a living engine. Its ranks are started once through a
launcher's `start` and run engine/serve_worker.py until `close()`; requests are submitted at
any time and stream their tokens back as the ranks take them.

    engine = OnlineEngine(spec, world_size=2, launcher=LocalLauncher())
    engine.submit(Request(engine.new_id(), ids, params), sink)   # sink(kind, payload), kind:
    engine.abort(index)                                          #   "token": (token id, logprobs),
    engine.close()                                               #   "finish": the result dict,
                                                                 #   "error": a line naming the cause
logprobs is None unless the request asked for them (SamplingParams.logprobs): then
{"logprob": float, "top": [(token id, logprob), ...]}.

A pump thread reads what rank 0 sends and calls each request's sink from that thread, and
watches the job: a rank that raises or dies ends every request still running with an error
naming it, and `error` says so from then on (the engine is dead; `healthy` is False).
Requests go to the DP replica with the fewest unfinished requests.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time

from atoll.engine.request import Request
from atoll.engine.runner import RunSpec
from atoll.engine.serve_worker import serve_worker
from atoll.errors import AtollError, LaunchError


class EngineDead(AtollError):
    """The engine's ranks failed; the line names the rank and the cause."""


class OnlineEngine:
    def __init__(self, spec: RunSpec, *, world_size: int, launcher, parallel=None, ready_timeout_s: float = 900):
        self.spec = spec
        self._inbox, self._outbox = launcher.channel(), launcher.channel()
        self.job = launcher.start(serve_worker, world_size, spec, self._inbox, self._outbox, parallel=parallel,
                                  device=spec.engine.device)
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
        self._thread = threading.Thread(target=self._pump, daemon=True, name="atoll-engine")
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.error is None and not self._closing

    def new_id(self) -> int:
        return next(self._ids)

    def submit(self, request: Request, sink) -> None:
        """Queue `request` (its index from new_id) for the ranks; `sink` gets its events."""
        with self._lock:
            if self.error is not None:
                raise EngineDead(self.error)
            if self._closing:
                raise EngineDead("the engine is shutting down")
            replica = self._load.index(min(self._load))
            self._load[replica] += 1
            self._sinks[request.index], self._replica[request.index] = sink, replica
        self._inbox.put(("add", request, replica))

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
            self._inbox.put(("stop",))
        except (OSError, ValueError):  # the queue is already gone
            pass
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
        try:
            if self.error is None:
                self.job.wait(timeout_s)
        except AtollError:
            pass
        finally:
            self.job.stop()
            self._fail("the engine was shut down")

    def _wait_ready(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            self.job.check(wait_s=0.05)  # a rank that failed while loading raises here
            try:
                msg = self._outbox.get_nowait()
            except queue.Empty:
                msg = None
            if msg is not None and msg[0] == "ready":
                return msg[1]
            if time.monotonic() > deadline:
                raise LaunchError(f"the engine's ranks were not ready within {timeout_s:.0f} s")

    def _pump(self) -> None:
        while True:
            try:
                msg = self._outbox.get(timeout=0.1)
            except queue.Empty:
                msg = None
            except (OSError, EOFError, ValueError):
                msg = None
            if msg is not None and msg[0] == "step":
                self._deliver(*msg[1:])
            if self._closing and msg is None:
                return
            if not self._closing:
                try:
                    self.job.check()
                except AtollError as e:
                    self._fail(str(e))
                    return

    def _deliver(self, tokens, finished, stats) -> None:
        with self._lock:
            sinks = dict(self._sinks)
            for index, _ in finished:
                self._sinks.pop(index, None)
                replica = self._replica.pop(index, None)
                if replica is not None:
                    self._load[replica] -= 1
            if stats is not None:
                self.stats = stats
        for index, token, *logprobs in tokens:
            sink = sinks.get(index)
            if sink is not None:
                sink("token", (token, logprobs[0] if logprobs else None))
        for index, result in finished:
            sink = sinks.get(index)
            if sink is not None:
                sink("finish", result)

    def _fail(self, line: str) -> None:
        with self._lock:
            if self.error is None:
                self.error = line
            sinks, self._sinks = self._sinks, {}
            self._replica.clear()
            self._load = [0] * len(self._load) if hasattr(self, "_load") else []
        for sink in sinks.values():
            sink("error", line)
