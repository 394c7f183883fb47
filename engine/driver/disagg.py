"""DisaggEngine: the driver's side of a living disaggregated engine (ranks:
engine/worker.py in the roles of engine/disagg/roles.py), X prefill engines and Y decode engines in one job (xPyD). It is an
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
A decode replica's cached prefix is what its engine reports: every step, the decode engine's
ranks send the names of the prefix blocks their pools named or evicted since the last one
(BlockPool.events, the engines' own block hashes), and the driver keeps each replica's set;
so a prompt whose blocks are still being computed there, or were evicted, counts as uncached.
With a shared KV store (--kv-shared) every block an engine names is written there too: blocks
named by a decode engine, or by a prefill engine of the same TP and PP split (the same slices),
count as cached for every decode replica, which reads them from the store instead of asking a
prefill engine to compute them again.
Each result's metrics say which path it took (prefilled_on; prefill_engine, which of them,
or None) and the KV bytes the prefill ranks sent for it (kv_bytes_sent, counted on those
ranks); `routed` counts the decisions:
prefill, decode (short or cached), queue (the prefill engines were full) and colocated (a
--colocated-replicas decode engine prefills every prompt it takes).

The local launcher runs it: every engine's ranks are one job on this machine.

Faults: engine/driver/disagg_faults.py (a dead engine's requests go on, with their tokens, on the others).
The admin API's changes (drain, serve again, change role): engine/driver/disagg_engines.py.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace

from atoll.engine.driver.channels import Merged
from atoll.engine.disagg.decision import Either, Recent, choose_path, uncached_tokens
from atoll.engine.disagg.routing import Routing
from atoll.engine.driver.disagg_engines import EngineChanges
from atoll.engine.driver.disagg_faults import EngineFailure, EngineFaults
from atoll.engine.rank.job import EngineJob
from atoll.engine.worker import worker
from atoll.engine.driver.living import engine_spec
from atoll.engine.driver.online import OnlineEngine
from atoll.engine.batch.request import Request
from atoll.errors import RankFailure
from atoll.parallel.parts import engine_of


def disagg_job(llm, requests=None) -> EngineJob:
    """The specs of a living disaggregated LLM's engines: the decode engines' as any living
    engine's; the prefill engines' the same on their own layout, never compiling a decode
    step (they sample one token a request)."""
    o = llm.options
    decode = engine_spec(llm, requests)
    prefill = replace(decode, layout=str(llm.prefill_layout), decode_steps=None).with_engine(enforce_eager=True)
    return EngineJob.disaggregated(prefill, decode, llm.context_options(), prefill_replicas=o.prefill_replicas,
                                   decode_replicas=o.decode_replicas)


class DisaggEngine(EngineChanges, EngineFaults, OnlineEngine):
    def __init__(self, job: EngineJob, *, launcher, min_prompt_tokens: int, max_prefill_queue: int | None = None,
                 ready_timeout_s: float = 900):
        self.live, self.layouts = job, job.layouts
        self._engines = len(self.layouts)
        self.x = job.prefill_replicas
        self.min_prompt_tokens, self.max_prefill_queue = min_prompt_tokens, max_prefill_queue
        self.remote_prompts: deque = deque(maxlen=512)  # (monotonic s, uncached tokens) sent to prefill engines
        self.routed = {"prefill": 0, "decode": 0, "queue": 0, "colocated": 0}
        self.migrations = 0  # requests moved off a dead engine with their tokens (engine.driver.disagg_faults)
        try:
            super().__init__(job.decode, world_size=sum(lay.world_size for lay in self.layouts), launcher=launcher,
                             parallel=job.options, ready_timeout_s=ready_timeout_s)
        except BaseException as e:
            if isinstance(self._outbox, Merged):  # its readers end with the job that failed to start
                self._outbox.close()
            if isinstance(e, RankFailure):
                raise self._named(e) from e
            raise

    def _start(self, launcher, world_size: int, parallel):
        """Each engine gets an inbox and an outbox of its own: a rank killed mid-write loses
        only its engine's channel (engine/driver/channels.py)."""
        self._inboxes = [launcher.channel() for _ in self.layouts]
        outboxes = [launcher.channel() for _ in self.layouts]
        job = launcher.start(worker, world_size, self.live, self._inboxes, outboxes, device=self.spec.engine.device)
        self._outbox = Merged(outboxes).start()
        return job

    def close(self, timeout_s: float = 30.0) -> None:
        try:
            super().close(timeout_s)
        finally:
            self._outbox.close()

    def _ready(self) -> None:
        dp = self.layouts[-1].dp
        # every engine's replicas: those of the engines in the decode role take requests (engine.disagg.routing)
        self._slots = [(e, d) for e, lay in enumerate(self.layouts) for d in range(lay.dp)]
        self._load = [0] * len(self._slots)
        self._seen = [set() for _ in self._slots]  # each decode replica's cached prefix blocks (its events)
        # with --kv-shared: blocks written to the shared store that the decode engines can read (named by
        # a decode engine, or by a prefill engine that slices the cache as they do)
        self._shared = Recent() if self.spec.engine.kv_shared else None
        pre, dec = self.layouts[0], self.layouts[-1]
        self._prefill_shares = (pre.tp, pre.pp) == (dec.tp, dec.pp)
        self._waiting = [0] * len(self.layouts)  # requests each prefill engine has not handed off yet
        self._where: dict[int, tuple[int, int | None]] = {}  # index -> (its decode slot, its prefill engine or None)
        self._handed: dict[int, Request] = {}  # remote request index -> its request, until its header comes
        self._aborted: set[int] = set()
        self._sent: dict[int, list[int]] = {}  # index -> [prefill ranks that reported, bytes]
        self._held: dict[int, dict] = {}  # results waiting for every prefill rank's byte count
        self._engine_stats: dict[str, dict] = {}
        self._stopped_engines: set[int] = set()
        self._dead: dict[int, str] = {}  # engine -> why it is dead
        self._labels = {self.live.name(e): e for e in range(len(self.layouts))}
        self._requests: dict[int, Request] = {}  # every unfinished request, to send again
        self._streamed: dict[int, list[int]] = {}  # requests whose first token reached their sink -> their tokens
        self._moved: dict[int, int] = {}  # requests moved off a dead engine with their tokens -> how many times
        self._told = False  # whether the decode engines were told to stop
        self._first: dict[int, int] = {}  # handed off, first token not out yet -> that token
        self._early: dict[int, tuple[list, list]] = {}  # ... -> the decode engine's tokens and end meanwhile
        # the engines drained by the admin API take nothing new; the colocated ones prefill their own prompts
        self.routing = Routing(self.layouts, self.x, self.spec.engine.colocated_replicas)
        self.taken = [0] * len(self.layouts)  # prompts each prefill engine took, requests each decode engine took

    def _least_loaded(self) -> int:
        return self.routing.least_loaded(self._load, self._slots)

    def submit_all(self, pairs: list) -> None:
        """Each path is decided as its request comes, in order (the decode replicas' caches)."""
        for request, sink in pairs:
            self.submit(request, sink)

    def submit(self, request: Request, sink) -> None:
        with self._lock:
            slot = self._take(request, sink)  # a decode replica of any live decode engine
            self._requests[request.index] = request
            sends = self._route(request, slot)
        self._post(sends)

    def _route(self, request: Request, slot: int) -> list:
        """Under the lock: the path of a request bound for decode replica `slot` (see the
        module docstring), recorded; the messages that send it there."""
        if request.generated:  # a migrated request: its decode engine computes its prompt and tokens
            self.routed["decode"] += 1
            self._where[request.index] = (slot, None)
            j, d = self._slots[slot]
            self.taken[j] += 1
            return [(j, ("add", request, d))]
        o = self.spec.engine
        held = self._seen[slot] if self._shared is None else Either(self._seen[slot], self._shared)
        new = uncached_tokens(request.prompt_token_ids, held, block_size=o.block_size,
                              prefix_caching=o.enable_prefix_caching, remember=False)
        j, d = self._slots[slot]
        path = choose_path(new, self.routing.prefill_waiting(self._waiting),
                           min_prompt_tokens=self.min_prompt_tokens, max_prefill_queue=self.max_prefill_queue,
                           colocated=j in self.routing.colocated)
        remote, prefill = path.remote, path.prefill
        self.routed[path.reason] += 1
        self._where[request.index] = (slot, prefill if remote else None)
        self.taken[j] += 1
        if remote:
            self.taken[prefill] += 1
        if not remote:
            return [(j, ("add", request, d))]
        self._handed[request.index] = request
        self._waiting[prefill] += 1
        self.remote_prompts.append((time.monotonic(), new))
        # the prefill engine draws the first token only (min_tokens kept for that token: its stops masked)
        first = replace(request, params=replace(request.params, max_tokens=1,
                                                min_tokens=min(request.params.min_tokens, 1)))
        return [(prefill, ("route", request.index, j, d)), (prefill, ("add", first, 0))]

    def _post(self, sends: list) -> None:
        for engine, msg in sends:
            self._inboxes[engine].put(msg)

    def abort(self, index: int) -> None:
        with self._lock:
            if index not in self._sinks:
                return
            self._aborted.add(index)
            slot, prefill = self._where[index]
        if prefill is not None:
            self._inboxes[prefill].put(("abort", index))
        self._inboxes[self._slots[slot][0]].put(("abort", index))

    def _handle(self, msg) -> None:
        kind = msg[0]
        if kind == "handoff":
            header = msg[1]
            with self._lock:
                if header.prefill in self._dead or self._handed.get(header.index) is None:
                    return  # its prefill engine died: the request was sent again or failed
                req = self._handed.pop(header.index)
                self._waiting[header.prefill] -= 1
                aborted = header.index in self._aborted
                dead = self._dead.get(header.decode)
            if dead is not None:  # its first token is on its way: another decode engine goes on from it
                with self._lock:
                    if header.index not in self._streamed:
                        self._first[header.index] = header.first  # (what that engine sends waits for it)
                if not self._migrate(header.index, [header.first]):
                    self._end_with(header.index, f"{self.live.name(header.decode)} failed: {dead}")
                return
            with self._lock:  # (under PP the step and the header come from different ranks: either first)
                if header.index not in self._streamed:
                    self._first[header.index] = header.first  # until its prefill engine's step brings it
            inbox = self._inboxes[header.decode]
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
        elif kind == "lost":  # a decode engine could not receive this prompt's KV: its prefill engine died
            _, index, prefill = msg
            self._learn_death(prefill)
            if prefill in self._dead and self._migrate(index):  # its first token is out: decoded on from it
                return
            why = self._dead.get(prefill, "its ranks stopped answering")
            self._end_with(index, f"{self.live.name(prefill)} failed while sending this request's KV cache: {why}")
        elif kind == "stopped":
            self._stopped_engines.add(msg[1])
            self._stop_decodes()

    def _stop_decodes(self) -> None:
        """Once every prefill engine is out (stopped or dead), nothing more is handed off: the
        decode engines may stop (once told to, which close() does through the prefill ones)."""
        if self._closing and not self._told and all(e in self._stopped_engines for e in self._role("prefill")):
            self._told = True
            for e in self._role("decode"):
                if e not in self._dead:
                    self._inboxes[e].put(("stop",))

    def _in_order(self, tokens, finished, decoded: bool) -> tuple[list, list]:
        """Under the lock: a handed-off request's first token comes in its prefill engine's step
        and the rest in the decode engine's, from two processes whose messages may cross on the
        way here; the decode engine's tokens and end wait until the first token is out.
        Returns (tokens, [(index, result, from a decode engine)])."""
        if decoded:
            out_tokens, out_done = [], []
            for entry in tokens:
                if entry[0] in self._first:
                    self._early.setdefault(entry[0], ([], []))[0].append(entry)
                else:
                    out_tokens.append(entry)
            for index, result in finished:
                if index in self._first:
                    self._early.setdefault(index, ([], []))[1].append((index, result, True))
                else:
                    out_done.append((index, result, True))
            return out_tokens, out_done
        out_tokens, out_done = [], [(index, result, False) for index, result in finished]
        for entry in tokens:
            out_tokens.append(entry)
            if self._first.pop(entry[0], None) is not None:  # its first token: what waited follows it
                early_tokens, early_done = self._early.pop(entry[0], ([], []))
                out_tokens += early_tokens
                out_done += early_done
        return out_tokens, out_done

    def _release_first(self, index: int) -> tuple[list, list]:
        """Under the lock: a handed-off request whose prefill engine died before its first token
        came: that token (from the header), then what waited for it."""
        first = self._first.pop(index, None)
        early_tokens, early_done = self._early.pop(index, ([], []))
        return ([(index, first, None)] if first is not None else []) + early_tokens, early_done

    def _deliver(self, tokens, finished, stats, engine: str | None = None) -> None:
        with self._lock:  # (by its role now: an engine's name is its launch role's)
            decoded = engine in self._labels and self.routing.roles[self._labels[engine]] == "decode"
            if self._labels.get(engine) in self._dead:  # sent before it died: its requests went elsewhere
                return
            tokens, done = self._in_order(tokens, finished, decoded)
        self._deliver_ordered(tokens, done, stats, engine)

    def _deliver_ordered(self, tokens, done, stats, engine) -> None:
        now = []
        with self._lock:
            for entry in tokens:
                self._streamed.setdefault(entry[0], []).append(entry[1])
            if self._moved:  # a moved request's prompt logprobs went out with its first token already
                tokens = [(*e[:3], None, *e[4:]) if e[0] in self._moved and len(e) > 3 else e for e in tokens]
            for index, result, decoded in done:
                self._requests.pop(index, None)
                self._streamed.pop(index, None)
                if index in self._moved:
                    result["metrics"]["migrations"] = self._moved.pop(index)
                _, prefill = self._where.pop(index, (None, None))
                remote = prefill is not None
                if remote and not decoded and index in self._handed:  # ended (aborted) in its prefill engine
                    del self._handed[index]
                    self._waiting[prefill] -= 1
                self._aborted.discard(index)
                sent = self._sent.get(index, [0, 0])
                result["metrics"] |= {"prefilled_on": "prefill" if remote else "decode", "kv_bytes_sent": sent[1],
                                      "prefill_engine": prefill}
                if remote and decoded and sent[0] < self.layouts[0].world_size and prefill not in self._dead:
                    self._held[index] = result  # a prefill rank's byte count is still on its way
                else:
                    self._sent.pop(index, None)
                    now.append((index, result))
        super()._deliver(tokens, now, stats, engine)

    def _take_stats(self, stats: dict, engine: str | None) -> None:
        events = stats.pop("kv_events", None)
        role = self.routing.roles[self._labels[engine]] if engine in self._labels else None
        if events and role == "prefill":  # a prefill engine's, to the store
            if self._prefill_shares and self._shared is not None:
                for _, named, name in events:
                    if named:
                        self._shared.add(name)
        elif events and engine in self._labels:  # a decode engine's pools named or evicted these prefix blocks
            j = self._labels[engine]
            for replica, named, name in events:
                if named and self._shared is not None:
                    self._shared.add(name)
                seen = self._seen[self._slots.index((j, replica))]
                if named:
                    seen.add(name)
                else:
                    seen.discard(name)
        self._engine_stats[engine] = stats
        parts = list(self._engine_stats.values())
        self.stats = {k: sum(p.get(k, 0) for p in parts) for k in parts[0]} | {"routed": dict(self.routed),
                                                                             "migrations": self.migrations}

    def _stop_ranks(self) -> None:
        self._told = False
        for e in self._role("prefill"):  # the decode ranks are told once the prefill ranks are out
            if e not in self._dead:
                self._inboxes[e].put(("stop",))
        self._stop_decodes()

    @property
    def _stopped(self) -> bool:
        return all(e in self._stopped_engines for e in self._role("decode"))

    def _describe(self, e) -> str:
        return str(self._named(e)) if isinstance(e, RankFailure) else str(e)

    def _named(self, e: RankFailure) -> RankFailure:
        if isinstance(e, EngineFailure):
            return e
        engine, local_rank = engine_of(self.layouts, e.rank)
        return EngineFailure(self.live.name(engine), local_rank, e)
