"""DisaggEngine: the driver's side of a living disaggregated engine (ranks:
engine/disagg_serve.py), X prefill engines and Y decode engines in one job (xPyD). It is an
OnlineEngine (submit, abort, close, the same sinks), whose requests each take one of two
paths, decided as they arrive:

- "prefill": a prefill engine computes the prompt and its first token, and its KV goes to a
  decode replica, which decodes on;
- "decode": the decode replica prefills the prompt itself, when what it would not find in its
  prefix cache is shorter than `--disagg-min-prompt-tokens`, or when
  `--disagg-max-prefill-queue` requests already wait in the prefill engines for their first
  token.

A request goes to the decode replica (of every decode engine's DP replicas) with the fewest
unfinished requests, and on the prefill path to the prefill engine with the fewest waiting.
A decode replica's cache is modelled here by the blocks of the prompts sent to it (as
engine.disagg.route does for a fixed list): blocks it has since evicted count as cached.
Each result's metrics say which path it took (prefilled_on; prefill_engine, which of them,
or None) and the KV bytes the prefill ranks sent for it (kv_bytes_sent, counted on those
ranks); `routed` counts the decisions:
prefill, decode (short or cached) and queue (the prefill engines were full).

The local launcher runs it: every engine's ranks are one job on this machine.
"""

from __future__ import annotations

from dataclasses import replace

from atoll.engine.disagg import EngineFailure, uncached_tokens
from atoll.engine.disagg_serve import LiveJob, disagg_serve_worker
from atoll.engine.living import engine_spec
from atoll.engine.online import OnlineEngine
from atoll.engine.request import Request
from atoll.errors import RankFailure
from atoll.parallel.parts import engine_of


def disagg_job(llm, requests=None) -> LiveJob:
    """The specs of a living disaggregated LLM's engines: the decode engines' as any living
    engine's; the prefill engines' the same on their own layout, never compiling a decode
    step (they sample one token a request)."""
    o = llm.options
    decode = engine_spec(llm, requests)
    prefill = replace(decode, layout=str(llm.prefill_layout), decode_steps=None).with_engine(enforce_eager=True)
    return LiveJob(prefill=prefill, decode=decode, options=llm.context_options(),
                   prefill_replicas=o.prefill_replicas, decode_replicas=o.decode_replicas)


class DisaggEngine(OnlineEngine):
    def __init__(self, job: LiveJob, *, launcher, min_prompt_tokens: int, max_prefill_queue: int | None = None,
                 ready_timeout_s: float = 900):
        self.live, self.layouts = job, job.layouts
        self._engines = len(self.layouts)
        self.x = job.prefill_replicas
        self.min_prompt_tokens, self.max_prefill_queue = min_prompt_tokens, max_prefill_queue
        self.routed = {"prefill": 0, "decode": 0, "queue": 0}
        try:
            super().__init__(job.decode, world_size=sum(lay.world_size for lay in self.layouts), launcher=launcher,
                             parallel=job.options, ready_timeout_s=ready_timeout_s)
        except RankFailure as e:
            raise self._named(e) from e

    def _start(self, launcher, world_size: int, parallel):
        self._inboxes = [launcher.channel() for _ in self.layouts]
        return launcher.start(disagg_serve_worker, world_size, self.live, self._inboxes, self._outbox,
                              device=self.spec.engine.device)

    def _ready(self) -> None:
        dp = self.layouts[-1].dp
        self._slots = [(j, d) for j in range(self.live.decode_replicas) for d in range(dp)]  # decode replicas
        self._load = [0] * len(self._slots)
        self._seen = [set() for _ in self._slots]  # block names sent to each decode replica
        self._waiting = [0] * self.x  # requests each prefill engine has not handed off yet
        self._where: dict[int, tuple[int, int | None]] = {}  # index -> (its decode slot, its prefill engine or None)
        self._handed: dict[int, Request] = {}  # remote request index -> its request, until its header comes
        self._aborted: set[int] = set()
        self._sent: dict[int, list[int]] = {}  # index -> [prefill ranks that reported, bytes]
        self._held: dict[int, dict] = {}  # results waiting for every prefill rank's byte count
        self._engine_stats: dict[str, dict] = {}
        self._stopped_engines: set[int] = set()

    def submit(self, request: Request, sink) -> None:
        o = self.spec.engine
        with self._lock:
            slot = self._take(request, sink)  # a decode replica of any decode engine
            new = uncached_tokens(request.prompt_token_ids, self._seen[slot], block_size=o.block_size,
                                  prefix_caching=o.enable_prefix_caching)
            prefill = self._waiting.index(min(self._waiting))
            full = self.max_prefill_queue is not None and sum(self._waiting) >= self.max_prefill_queue
            remote = new >= self.min_prompt_tokens and not full
            self.routed["prefill" if remote else "queue" if new >= self.min_prompt_tokens else "decode"] += 1
            self._where[request.index] = (slot, prefill if remote else None)
            if remote:
                self._handed[request.index] = request
                self._waiting[prefill] += 1
        j, d = self._slots[slot]
        if remote:
            first = replace(request, params=replace(request.params, max_tokens=1))
            self._inboxes[prefill].put(("route", request.index, j, d))
            self._inboxes[prefill].put(("add", first, 0))
        else:
            self._inboxes[self.x + j].put(("add", request, d))

    def abort(self, index: int) -> None:
        with self._lock:
            if index not in self._sinks:
                return
            self._aborted.add(index)
            slot, prefill = self._where[index]
        if prefill is not None:
            self._inboxes[prefill].put(("abort", index))
        self._inboxes[self.x + self._slots[slot][0]].put(("abort", index))

    def _handle(self, msg) -> None:
        kind = msg[0]
        if kind == "handoff":
            header = msg[1]
            with self._lock:
                req = self._handed.pop(header.index)
                self._waiting[header.prefill] -= 1
                aborted = header.index in self._aborted
            inbox = self._inboxes[self.x + header.decode]
            inbox.put(("adopt", header, req))
            if aborted:  # the abort may have reached the decode ranks before the header
                inbox.put(("abort", header.index))
        elif kind == "sent":
            _, index, nbytes = msg
            with self._lock:
                count = self._sent.setdefault(index, [0, 0])
                count[0] += 1
                count[1] += nbytes
                done = count[0] == self.layouts[0].world_size and index in self._held
                result = self._held.pop(index) if done else None
                if result is not None:  # held for this count: its metric now has every rank's bytes
                    result["metrics"]["kv_bytes_sent"] = self._sent.pop(index)[1]
            if result is not None:
                super()._deliver([], [(index, result)], None)
        elif kind == "stopped":
            self._stopped_engines.add(msg[1])
            if all(e in self._stopped_engines for e in range(self.x)):
                for inbox in self._inboxes[self.x:]:  # the prefill ranks are out: nothing more to hand off
                    inbox.put(("stop",))

    def _deliver(self, tokens, finished, stats, engine: str | None = None) -> None:
        now = []
        decoded = engine is not None and engine.startswith("decode")
        with self._lock:
            for index, result in finished:
                _, prefill = self._where.pop(index, (None, None))
                remote = prefill is not None
                if remote and not decoded and index in self._handed:  # ended (aborted) in its prefill engine
                    del self._handed[index]
                    self._waiting[prefill] -= 1
                self._aborted.discard(index)
                sent = self._sent.get(index, [0, 0])
                result["metrics"] |= {"prefilled_on": "prefill" if remote else "decode", "kv_bytes_sent": sent[1],
                                      "prefill_engine": prefill}
                if remote and decoded and sent[0] < self.layouts[0].world_size:
                    self._held[index] = result  # a prefill rank's byte count is still on its way
                else:
                    self._sent.pop(index, None)
                    now.append((index, result))
        super()._deliver(tokens, now, stats, engine)

    def _take_stats(self, stats: dict, engine: str | None) -> None:
        self._engine_stats[engine] = stats
        parts = list(self._engine_stats.values())
        self.stats = {k: sum(p.get(k, 0) for p in parts) for k in parts[0]} | {"routed": dict(self.routed)}

    def _stop_ranks(self) -> None:
        for inbox in self._inboxes[: self.x]:  # the decode ranks are told once the prefill ranks are out
            inbox.put(("stop",))

    @property
    def _stopped(self) -> bool:
        return all(e in self._stopped_engines for e in range(self.x, len(self.layouts)))

    def _describe(self, e) -> str:
        return str(self._named(e)) if isinstance(e, RankFailure) else str(e)

    def _named(self, e: RankFailure) -> RankFailure:
        if isinstance(e, EngineFailure):
            return e
        engine, local_rank = engine_of(self.layouts, e.rank)
        return EngineFailure(self.live.name(engine), local_rank, e)
