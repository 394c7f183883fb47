"""DisaggEngine: the driver's side of a living disaggregated engine (ranks:
engine/disagg_serve.py). It is an OnlineEngine (submit, abort, close, the same sinks), whose
requests each take one of two paths, decided as they arrive:

- "prefill": the prefill engine computes the prompt and its first token, and its KV goes to
  the decode replica, which decodes on;
- "decode": the decode replica prefills the prompt itself, when what it would not find in its
  prefix cache is shorter than `--disagg-min-prompt-tokens`.

A decode replica's cache is modelled here by the blocks of the prompts sent to it (as
engine.disagg.route does for a fixed list): blocks it has since evicted count as cached.
Each result's metrics say which path it took (prefilled_on) and the KV bytes the prefill
ranks sent for it (kv_bytes_sent, counted on those ranks); `routed` counts both paths.

The local launcher runs it: both engines' ranks are one job on this machine.
"""

from __future__ import annotations

from dataclasses import replace

from atoll.engine.disagg import EngineFailure, uncached_tokens
from atoll.engine.disagg_serve import LiveJob, disagg_serve_worker
from atoll.engine.living import engine_spec
from atoll.engine.online import EngineDead, OnlineEngine
from atoll.engine.request import Request
from atoll.errors import RankFailure
from atoll.parallel.parts import engine_of

ENGINES = ("prefill", "decode")


def disagg_job(llm, requests=None) -> LiveJob:
    """The specs of a living disaggregated LLM's two engines: the decode engine's as any living
    engine's; the prefill engine's the same on its own layout, never compiling a decode step
    (it samples one token a request)."""
    decode = engine_spec(llm, requests)
    prefill = replace(decode, layout=str(llm.prefill_layout), decode_steps=None).with_engine(enforce_eager=True)
    return LiveJob(prefill=prefill, decode=decode, options=llm.context_options())


class DisaggEngine(OnlineEngine):
    _engines = 2

    def __init__(self, job: LiveJob, *, launcher, min_prompt_tokens: int, ready_timeout_s: float = 900):
        self.live, self.layouts = job, job.layouts
        self.min_prompt_tokens = min_prompt_tokens
        self.routed = {"prefill": 0, "decode": 0}
        try:
            super().__init__(job.decode, world_size=sum(lay.world_size for lay in self.layouts), launcher=launcher,
                             parallel=job.options, ready_timeout_s=ready_timeout_s)
        except RankFailure as e:
            raise self._named(e) from e

    def _start(self, launcher, world_size: int, parallel):
        self._prefill_inbox = launcher.channel()
        return launcher.start(disagg_serve_worker, world_size, self.live, self._prefill_inbox, self._inbox,
                              self._outbox, device=self.spec.engine.device)

    def _ready(self) -> None:
        self._seen = [set() for _ in range(self.info["replicas"])]  # block names sent to each decode replica
        self._handed: dict[int, Request] = {}  # remote request index -> its request, until its header comes
        self._remote: set[int] = set()  # indices on the prefill path, until they end
        self._aborted: set[int] = set()
        self._sent: dict[int, list[int]] = {}  # index -> [prefill ranks that reported, bytes]
        self._held: dict[int, dict] = {}  # results waiting for every prefill rank's byte count
        self._engine_stats: dict[str, dict] = {}
        self._stopped_engines: set[int] = set()

    def submit(self, request: Request, sink) -> None:
        o = self.spec.engine
        with self._lock:
            if self.error is not None:
                raise EngineDead(self.error)
            if self._closing:
                raise EngineDead("the engine is shutting down")
            replica = self._load.index(min(self._load))
            self._load[replica] += 1
            self._sinks[request.index], self._replica[request.index] = sink, replica
            new = uncached_tokens(request.prompt_token_ids, self._seen[replica], block_size=o.block_size,
                                  prefix_caching=o.enable_prefix_caching)
            remote = new >= self.min_prompt_tokens
            self.routed["prefill" if remote else "decode"] += 1
            if remote:
                self._handed[request.index] = request
                self._remote.add(request.index)
        if remote:
            first = replace(request, params=replace(request.params, max_tokens=1))
            self._prefill_inbox.put(("route", request.index, replica))
            self._prefill_inbox.put(("add", first, 0))
        else:
            self._inbox.put(("add", request, replica))

    def abort(self, index: int) -> None:
        with self._lock:
            if index not in self._sinks:
                return
            self._aborted.add(index)
            remote = index in self._remote
        if remote:
            self._prefill_inbox.put(("abort", index))
        self._inbox.put(("abort", index))

    def _handle(self, msg) -> None:
        kind = msg[0]
        if kind == "handoff":
            header = msg[1]
            with self._lock:
                req = self._handed.pop(header.index)
                aborted = header.index in self._aborted
            self._inbox.put(("adopt", header, req))
            if aborted:  # the abort may have reached the decode ranks before the header
                self._inbox.put(("abort", header.index))
        elif kind == "sent":
            _, index, nbytes = msg
            with self._lock:
                count = self._sent.setdefault(index, [0, 0])
                count[0] += 1
                count[1] += nbytes
                done = count[0] == self.layouts[0].world_size and index in self._held
                result = self._held.pop(index) if done else None
            if result is not None:
                super()._deliver([], [(index, result)], None)
        elif kind == "stopped":
            self._stopped_engines.add(msg[1])
            if msg[1] == 0:  # the prefill ranks are out: nothing more comes to hand off
                self._inbox.put(("stop",))

    def _deliver(self, tokens, finished, stats, engine: str | None = None) -> None:
        now = []
        with self._lock:
            for index, result in finished:
                remote = index in self._remote
                self._remote.discard(index)
                self._aborted.discard(index)
                self._handed.pop(index, None)
                sent = self._sent.get(index, [0, 0])
                result["metrics"] |= {"prefilled_on": "prefill" if remote else "decode",
                                      "kv_bytes_sent": sent[1]}
                if remote and engine == "decode" and sent[0] < self.layouts[0].world_size:
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
        self._prefill_inbox.put(("stop",))  # the decode ranks are told once the prefill ranks are out

    @property
    def _stopped(self) -> bool:
        return 1 in self._stopped_engines

    def _describe(self, e) -> str:
        return str(self._named(e)) if isinstance(e, RankFailure) else str(e)

    def _named(self, e: RankFailure) -> RankFailure:
        if isinstance(e, EngineFailure):
            return e
        engine, local_rank = engine_of(self.layouts, e.rank)
        return EngineFailure(ENGINES[engine], local_rank, e)
