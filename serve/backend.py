"""The server's side of the living engine: admission (queue limit, health, draining), a
request's prompts into engine requests, their events back on the event loop, and the
counting that /metrics shows.

A request is aborted in the engine (its blocks freed) whenever its reader stops early: a
client that disconnects, a deadline at shutdown, an error in a sibling choice."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from atoll.engine.batch.copies import copies_of
from atoll.errors import AtollError, InputError
from atoll.serve.metrics import Metrics
from atoll.serve.protocol import ApiError
from atoll.serve.stream import EventQueue


@dataclass(eq=False)  # a call is itself: kept in a set
class Call:
    """One HTTP request in the engine: its engine requests (one per choice) and their events."""

    requests: list  # engine Requests, index = the engine's id
    events: EventQueue
    arrived: float
    open: set = field(default_factory=set)  # engine ids not finished yet
    first: dict = field(default_factory=dict)  # choice -> time of its first token
    last: dict = field(default_factory=dict)  # choice -> time of its latest token
    logprobs: bool = False  # the request asked for them
    n: int = 1  # choices per prompt: choice k is copy k % n of prompt k // n (engine.batch.copies)


class Backend:
    def __init__(self, llm, engine, *, max_waiting: int | None = None, metrics: Metrics | None = None):
        self.llm, self.engine = llm, engine
        self.max_waiting = max_waiting
        self.metrics = metrics or Metrics(lambda: engine.stats)
        self.calls: set[Call] = set()
        self.waiting = 0  # engine requests submitted that have no token yet
        self.draining: str | None = None  # why new requests are refused (shutting down)

    @property
    def healthy(self) -> bool:
        return self.engine.error is None and self.draining is None

    def check_admission(self, n: int = 1) -> None:
        """Refuse new work while the engine is dead or the server drains (503), or when the
        queue is full (429); both carry Retry-After."""
        if self.engine.error is not None:
            raise ApiError(503, f"the engine is down: {self.engine.error}", type="server_error",
                           code="engine_dead", retry_after=5)
        if self.draining is not None:
            raise ApiError(503, self.draining, type="server_error", code="shutting_down", retry_after=5)
        if self.max_waiting is not None and self.waiting + n > self.max_waiting:
            raise ApiError(429, f"the queue is full: {self.waiting} requests are waiting "
                                f"(--max-waiting-requests {self.max_waiting}); retry later",
                           type="rate_limit_error", code="queue_full", retry_after=1)

    def prepare(self, prompts: list, params, *, param: str = "prompt") -> list:
        """Engine requests for prompts (text or token ids); a bad prompt is a 400 naming it."""
        errors: dict[int, str] = {}
        try:
            requests = self.llm.prepare(prompts, params, errors=errors)
        except InputError as e:
            raise ApiError(400, str(e), param=param) from None
        if errors:
            k = min(errors)
            msg = errors[k]
            if len(prompts) > 1:
                msg = f"{param}[{k}]: {msg}"
            elif not msg.startswith(param):
                msg = f"{param}: {msg}"
            raise ApiError(400, msg, param=param, code=_code(msg))
        return requests

    def start(self, requests: list, *, arrived: float | None = None) -> Call:
        """Submit the requests to the engine, each as its params.n copies (the choices, in
        order: a prompt's copies side by side, each after the first forking from it, except
        in a disaggregated job whose engines may run them apart); `arrived`
        (time.monotonic()), when the HTTP request came, is where its latencies start
        (default: now)."""
        n = requests[0].params.n if requests else 1
        self.check_admission(len(requests) * n)
        loop = asyncio.get_running_loop()
        call = Call([], None, time.monotonic() if arrived is None else arrived, n=n)
        call.events = EventQueue(loop, lambda choice, kind, payload, t: self._count(call, choice, kind, payload, t))
        self.calls.add(call)
        share = getattr(self.llm, "prefill_layout", None) is None
        try:
            for req in requests:
                copies = copies_of(req, [self.engine.new_id() for _ in range(req.params.n)], share=share)
                pairs = [(c, call.events.sink_for(len(call.requests) + j)) for j, c in enumerate(copies)]
                if len(pairs) > 1 and hasattr(self.engine, "submit_all"):
                    self.engine.submit_all(pairs)  # one tick: the copies wait for the first one's prompt
                    self._opened(call, copies)
                else:
                    for pair in pairs:
                        self.engine.submit(*pair)
                        self._opened(call, [pair[0]])
        except AtollError as e:  # the engine died or closed between the check and the submit
            self.end(call)
            raise ApiError(503, str(e), type="server_error", code="engine_dead") from None
        return call

    def _opened(self, call: Call, requests: list) -> None:
        for req in requests:
            call.requests.append(req)
            call.open.add(req.index)
            self.waiting += 1

    def end(self, call: Call) -> None:
        """The reader is done with the call: abort whatever still runs (its blocks are freed)."""
        for index in list(call.open):
            self.engine.abort(index)
        self.calls.discard(call)

    def fail_all(self, line: str) -> None:
        """End every call in flight with an error (the shutdown deadline passed)."""
        now = time.monotonic()
        for call in list(self.calls):
            for choice, req in enumerate(call.requests):
                if req.index in call.open:
                    self.engine.abort(req.index)
                    self._close(call, choice)
                    self.metrics.failed.labels("shutdown").inc()
            self.calls.discard(call)
            call.events.queue.put_nowait((None, "error", line, now))

    def _count(self, call: Call, choice: int, kind: str, payload, t: float) -> None:
        """Every event, on the loop, before its reader sees it (or even if none reads it)."""
        m = self.metrics
        if kind == "token":
            if choice not in call.first:
                call.first[choice] = t
                self.waiting -= 1
                m.ttft.observe(t - call.arrived)
            else:
                m.itl.observe(t - call.last[choice])
            call.last[choice] = t
            m.generation_tokens.inc()
            return
        if not self._close(call, choice):
            return
        if kind == "finish":
            m.request_finished(payload, arrived=call.arrived, now=t)
        else:
            m.failed.labels("engine").inc()
        if not call.open:
            self.calls.discard(call)

    def _close(self, call: Call, choice: int) -> bool:
        """Mark a choice's engine request ended; False if it already was."""
        index = call.requests[choice].index
        if index not in call.open:
            return False
        call.open.discard(index)
        if choice not in call.first:
            self.waiting -= 1
        return True


def _code(message: str) -> str | None:
    return "context_length_exceeded" if "max_model_len" in message else None
