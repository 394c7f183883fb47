"""The disaggregated driver's faults (engine/driver/disagg.py's DisaggEngine mixes this in).

An engine whose rank dies is ended alone, named; the rest of the job goes on, and so do its
requests (where the launcher can end some ranks of a job: `give_up` of the local and Ray jobs). The
driver ends the dead engine's other ranks and stops routing to it. A request that has streamed
no token yet is sent again: one waiting in a dead prefill engine goes to another prefill engine
(or, with none left, is prefilled by its decode replica), one waiting in a dead decode engine to
another decode replica. A request whose first token has streamed (or is on its way) moves with
its tokens to a live decode engine, which computes its prompt and those tokens and decodes on
(`_migrate`; greedy and seeded tokens as without the fault): one decoding in the dead engine,
one whose KV a dead prefill engine was sending (the decode ranks' receive fails: they drop it
together and say so, "lost"), and one handed off to a dead decode engine. Only with no live
decode engine to take it does it end with an error naming the engine. Gloo's point-to-point
transfers to a dead peer fail at once rather than hang, and the surviving engines' own groups
do not involve it. With no decode engine left the whole engine fails. `degraded` names the dead engines (the server's /health).

With `heals` set (atoll serve under --restart-policy on-failure, serve.replica_start.start_disagg)
none of this happens: an engine's failure fails the whole job, and the server starts it again
with the requests continuing there with their tokens.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import replace

from atoll.errors import AtollError, RankFailure
from atoll.parallel.parts import bases, engine_of


class EngineFailure(RankFailure):
    """A rank of one engine of a disaggregated job failed: names the engine and its rank there."""

    def __init__(self, engine: str, local_rank: int, failure: RankFailure):
        """engine: its label, "prefill engine" or "decode engine 1"."""
        where = f"{engine} rank {local_rank} (job rank {failure.rank}" + \
            (f" on {failure.node})" if failure.node else ")")
        AtollError.__init__(self, f"{where} failed: {failure.cause}")
        self.engine, self.rank, self.cause, self.node = engine, failure.rank, failure.cause, failure.node


class EngineFaults:
    """What DisaggEngine does when ranks of one of its engines fail. It reads the driver's
    state (_where, _handed, _first, _held, _slots, _load, _waiting, ...) under its lock."""

    @property
    def degraded(self) -> dict[str, str]:
        """The dead engines by name, and why (empty while every engine serves)."""
        return {self.live.name(e): line for e, line in sorted(self._dead.items())}

    def _survive(self, e) -> bool:
        """A rank of one engine failed: end that engine, send its requests on or fail them (the
        module docstring), and go on, unless no decode engine would be left."""
        if not isinstance(e, RankFailure) or not hasattr(self.job, "give_up") or getattr(self, "heals", False):
            return False  # heals: the server restarts the whole job (serve.replica_start.start_disagg)
        engine, _ = engine_of(self.layouts, e.rank)
        with self._lock:
            if engine in self._dead:
                return True  # a peer of an engine already ended
            decoders = [j for j in self._role("decode") if j not in self._dead and j != engine]
            if not decoders:
                return False
            self._dead[engine] = line = str(self._named(e))
            self._stopped_engines.add(engine)
            self._route_around(engine)  # at once: /health says degraded now, and a request may follow
            self._engine_stats.pop(self.live.name(engine), None)
        print(f"atoll: {line}; the other engines go on without it", file=sys.stderr, flush=True)
        base = bases(self.layouts)[engine]
        self.job.give_up(range(base, base + self.layouts[engine].world_size))
        cancel = getattr(self._inboxes[engine], "cancel_join_thread", None)
        if cancel is not None:  # what waits for its dead reader must not hold up this process's exit
            cancel()
        again, move, held = self._orphans(engine)
        for index in move:  # with the tokens it streamed, on a live decode engine
            with self._lock:  # a first token still on its way in a live prefill engine's step counts
                first = [self._first[index]] if index in self._first else None
            if not self._migrate(index, first):
                self._end_with(index, line)
        for index in self._handed_from(engine):  # their first token will not come in its step
            with self._lock:
                tokens, done = self._release_first(index)
            self._deliver_ordered(tokens, done, None, None)
        for index, result in held:  # their byte counts will not all come
            super()._deliver([], [(index, result)], None)
        for index in again:
            self._again(index)
        if self._closing:
            self._stop_decodes()
        return True

    def _route_around(self, engine: int) -> None:
        """No new request goes to the dead engine (under the lock): its prefill queue or its
        decode slots read as full."""
        self._waiting[engine] = math.inf
        for slot, (j, _) in enumerate(self._slots):
            if j == engine:
                self._load[slot] = math.inf

    def _learn_death(self, engine: int, wait_s: float = 3.0) -> None:
        """Wait briefly for the launcher to report the death the ranks saw first (a closed
        connection), so that the request's error names the rank and its cause."""
        deadline = time.monotonic() + wait_s
        while engine not in self._dead and self.error is None and time.monotonic() < deadline:
            try:
                self.job.check(wait_s=0.1)
            except AtollError as e:
                if not self._survive(e):
                    self._fail(self._describe(e))

    def _orphans(self, engine: int) -> tuple[list[int], list[int], list]:
        """The dead engine's requests: (to send again, to move with their tokens, results held for
        its byte counts); it gets no more."""
        again, move, held = [], [], []
        with self._lock:
            if self.routing.roles[engine] == "prefill":
                for index in [i for i, (_, p) in self._where.items() if p == engine and i in self._handed]:
                    del self._handed[index]
                    (move if index in self._streamed else again).append(index)
                for index in [i for i, r in self._held.items() if self._where.get(i, (0, engine))[1] == engine]:
                    held.append((index, self._held.pop(index)))
            else:
                for index, (slot, prefill) in list(self._where.items()):
                    if self._slots[slot][0] != engine or index in self._handed:
                        continue  # (one still in a prefill engine moves at its handoff)
                    (move if index in self._streamed or prefill is not None else again).append(index)
        return again, move, held

    def _handed_from(self, engine: int) -> list[int]:
        """Requests a prefill engine handed off whose first token has not come out yet."""
        with self._lock:
            return [i for i in self._first if self._where.get(i, (None, None))[1] == engine]

    def _again(self, index: int) -> None:
        """Send a request that streamed nothing yet on another path, on live engines."""
        with self._lock:
            request = self._requests.get(index)
            if request is None or index not in self._sinks:
                return
            slot, _ = self._where[index]
            if self._slots[slot][0] in self._dead:  # a new decode replica
                self._load[slot] = self._load[slot] if self._load[slot] == math.inf else self._load[slot] - 1
                slot = self._least_loaded()
                self._load[slot] += 1
                self._replica[index] = slot
            sends = self._route(request, slot)
        self._post(sends)

    def _migrate(self, index: int, tokens: list[int] | None = None) -> bool:
        """Move a request off a dead engine with its tokens (those it streamed, or `tokens`): a
        live decode engine computes its prompt and them, and decodes on (as serve.replicas
        migrates between replicas). False: it has ended already, or no decode engine is left."""
        with self._lock:
            request = self._requests.get(index)
            if request is None or index not in self._sinks:
                return index not in self._sinks
            made = list(self._streamed.get(index, [])) if tokens is None else list(tokens)
            self._requests[index] = replace(request, generated=made, fork_of=None)
            self._moved[index] = self._moved.get(index, 0) + 1
            self.migrations += 1
            self._handed.pop(index, None)
        try:
            self._again(index)
        except (ValueError, KeyError):
            return False
        return True

    def _end_with(self, index: int, line: str) -> None:
        """End one request with an error line (its engine died)."""
        with self._lock:
            sink = self._sinks.pop(index, None)
            slot = self._replica.pop(index, None)
            if slot is not None and self._load[slot] != math.inf:
                self._load[slot] -= 1
            _, prefill = self._where.pop(index, (None, None))
            if self._handed.pop(index, None) is not None and prefill is not None \
                    and self._waiting[prefill] != math.inf:
                self._waiting[prefill] -= 1
            self._requests.pop(index, None)
            self._streamed.pop(index, None)
            self._moved.pop(index, None)
            self._first.pop(index, None)
            self._early.pop(index, None)
        if sink is not None:
            sink("error", line)
