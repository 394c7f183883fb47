"""The discrete-event loop: requests arrive as `atoll bench serve` sends them, the driver's own
choices send each to an engine, and every engine ticks on the cost model's clock.

- Arrivals: load.arrival_times with the bench's seed; under max_concurrency a request waits for
  a free slot, as the bench's semaphore makes it wait.
- Colocated replicas: the router the server runs (engine.batch.router: cache-aware or
  round-robin), fed each replica's unfinished requests.
- Disaggregation: the decode replica with the fewest unfinished requests (the driver's
  choice), then engine.disagg.decision's path for the prompt's part that replica has not
  cached (its pools' own cache events keep that set, as the driver's do). A remote prompt runs
  on the least-waiting prefill engine with max_tokens 1; its first token reaches the client
  as it is sampled; its KV then crosses the link between the two engines' first GPUs
  (planner/collectives.send_recv, the prefill engine's TP ranks sending in parallel). The
  prefill engine's next tick waits for the send, and the decode engine's tick that takes the
  sequence waits for the receive, as their ranks do.
- The API server takes requests one at a time: each reaches the engines INTAKE_S after the
  later of its sending and the one before it. So a request sent as another ends joins the
  tick after next, and requests sent together reach an idle engine one by one (the first starts a
  tick alone), as on the server.
- A client sees a chunk per engine tick that gave its request tokens: TTFT, ITL and E2EL as
  the bench measures them (report.py).
- Conversations (load.multi_turn_requests): a later turn is sent when the turn before it ends,
  behind the requests already waiting for a place, as bench serve --scenario kv-tiers sends it;
  only first turns take arrival times.
- KV cache tiers (tiers.py): each engine's DP replicas get their own host and disk tiers; a
  shared store is one for every engine of the same layout.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from atoll.config.sampling import SamplingParams
from atoll.engine.batch.request import Request
from atoll.engine.batch.router import make_router
from atoll.engine.batch.scheduler import Sequence
from atoll.engine.disagg.decision import choose_path, uncached_tokens
from atoll.planner.collectives import GroupLinks, send_recv
from atoll.planner.sim.engine import SimEngine
from atoll.planner.sim.load import arrival_times

# the API server's time to take one request (HTTP, tokenizing, the engine's queue): from a client's
# send to the engine's tick start, 2.6-3.3 ms (median 2.9) on this project's 2-core machine
# (SmolLM2-135M, a 120-token prompt, an idle TP1 server); what matters most is that it is there
INTAKE_S = 0.003
from atoll.planner.sim.report import RequestResult
from atoll.planner.sim.tiers import SimTiers, Store, pending_bytes, figures as tier_figures

MAX_EVENTS_PER_REQUEST = 100_000  # a bound on the loop: a deployment that cannot progress ends with an error


@dataclass
class Client:
    """One request as its client sees it."""
    prompt: list[int]
    output_len: int
    arrival: float
    start: float | None = None
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0
    end: float | None = None
    cached_tokens: int = 0
    error: str = ""

    def result(self) -> RequestResult:
        r = RequestResult(prompt_tokens=len(self.prompt), start=self.start or 0.0, usage=True, error=self.error)
        if self.error or self.end is None or not self.chunks:
            r.error = self.error or "never finished"
            return r
        r.success, r.output_tokens = True, self.tokens
        r.ttft, r.latency = self.chunks[0] - self.start, self.chunks[-1] - self.start
        r.itl = [b - a for a, b in zip(self.chunks, self.chunks[1:])]
        return r


class _Ranks:
    """Engines' ranks laid one after another over the topology's GPUs (parallel.parts' order)."""

    def __init__(self, topology):
        self.order = topology.gpu_order()
        self.topology = topology

    def node_of(self, rank: int) -> int:
        return self.order[rank % len(self.order)][0]

    def island_of(self, rank: int) -> int:
        return self.topology.island_of(self.order[rank % len(self.order)])


class Simulation:
    def __init__(self, deployment, kinds: list, requests: list, *, topology, kv_bytes_per_token: float,
                 rate: float = math.inf, burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
                 progress=None, memos: dict | None = None, fast: bool = True):
        """kinds: the EngineKind of the replicas (one), or of the prefill and the decode engines
        (two); requests: load.BenchRequest with token-id prompts; kv_bytes_per_token: the
        model's KV bytes per token over all layers (the hand-off's size); memos: the costed steps
        of each kind, kept across runs of one deployment (an SLO search's rates); fast: steady
        decode fast-forwarded (steady.py: the same figures, fewer steps)."""
        self.d, self.progress = deployment, progress
        firsts = [i for i, r in enumerate(requests) if r.after is None]
        times = dict(zip(firsts, arrival_times(len(firsts), rate=rate, burstiness=burstiness, seed=seed)))
        self.clients = [Client(r.prompt, r.output_len, times.get(i, math.inf)) for i, r in enumerate(requests)]
        self.next_turns: dict[int, list[int]] = {}  # request index -> the turns its end sends
        for i, r in enumerate(requests):
            if i not in times:
                self.next_turns.setdefault(r.after, []).append(i)
        self.cap = max_concurrency
        self.events: list = []
        self.order = 0
        self.in_flight, self.blocked = 0, deque()
        self.intake_free = 0.0  # when the API server is done with the last request it took
        self.done = 0
        self.kv_bytes_per_token = kv_bytes_per_token
        d = deployment
        memos = {} if memos is None else memos
        self.shared: dict[str, Store] = {}  # layout -> the shared store its engines read and write

        def engine(name: str, kind, seed_: int, drafts: bool = True) -> SimEngine:
            cost = kind.step_cost()
            cost.memo = memos.setdefault(id(kind), cost.memo)  # engines of one layout share their steps
            tiers = self._tiers(kind) if d.tiered else None
            return SimEngine(name, cost, layout=str(kind.layout), num_blocks=kind.num_blocks,
                             block_size=d.block_size, max_num_seqs=d.max_num_seqs,
                             max_num_batched_tokens=kind.max_num_batched_tokens, max_model_len=kind.max_model_len,
                             pp=kind.layout.pp, dp=kind.layout.dp, prefix_caching=d.prefix_caching,
                             spec_k=d.spec_tokens if drafts else 0, acceptance=d.acceptance,
                             draft_rate=d.draft_rate, seed=seed + seed_, on_chunk=self._chunk, on_end=self._ended,
                             on_retime=self._retime, fast=fast, tiers=tiers)

        if d.disaggregated:
            pk, dk = kinds
            self.prefills = [engine(f"prefill{i}", pk, i, drafts=False) for i in range(d.prefill_replicas)]
            self.decodes = [engine(f"decode{j}", dk, 100 + j) for j in range(d.decode_replicas)]
            self.engines = self.prefills + self.decodes
            for e in self.decodes:
                for pool in e.pools():
                    pool.events = []
            self.seen = [set() for _ in self.decodes]
            self.waiting = [0] * len(self.prefills)
            self.routed = {"prefill": 0, "decode": 0, "queue": 0}
            self.links = self._links(pk.layout.world_size, dk.layout.world_size, topology)
            self.prefill_tp = pk.layout.tp
        else:
            (k,) = kinds
            self.engines = [engine(f"replica{i}", k, i) for i in range(d.replicas)]
            self.prefills, self.decodes = [], []
            self.router = make_router(d.router, capacities=[k.num_blocks * k.layout.dp] * d.replicas,
                                      block_size=d.block_size, imbalance=max(1, d.max_num_seqs // 4))
            self.routed: dict[str, int] = {}
        self.where: dict[int, SimEngine] = {}  # request index -> the engine that decodes it
        self.bound: dict[int, tuple[SimEngine, int]] = {}  # remote prompt -> (its prefill engine, decode slot)
        self.stall: dict[int, float] = {}  # engine id -> when its ranks are done sending (prefill)

    def _tiers(self, kind):
        """make_tiers(clock) for an engine of `kind`: a DP replica's host and disk tiers, and the
        shared store of its layout."""
        cap, speeds, bb = kind.capacity, kind.speeds, kind.capacity.block_bytes
        if self.d.kv_shared and str(kind.layout) not in self.shared:
            self.shared[str(kind.layout)] = Store("shared", None, speeds["shared"], bb)
        shared = self.shared.get(str(kind.layout))

        def make(clock) -> SimTiers:
            stores = [Store("host", cap.host_blocks, speeds["host"], bb)] if cap.host_blocks else []
            if cap.disk_blocks != 0:
                stores.append(Store("disk", cap.disk_blocks, speeds["disk"], bb))
            return SimTiers(stores + ([shared] if shared is not None else []), clock, bb,
                            max_pending=pending_bytes(self.d.kv_offload_gb * 2**30))
        return make

    def _links(self, wp: int, wd: int, topology) -> list[list[GroupLinks]]:
        ranks, d = _Ranks(topology), self.d
        first_decode = d.prefill_replicas * wp
        return [[GroupLinks.of([i * wp, first_decode + j * wd], ranks, topology) for j in range(d.decode_replicas)]
                for i in range(d.prefill_replicas)]

    # -- the loop -------------------------------------------------------------------------
    def _push(self, t: float, kind: str, data) -> None:
        self.order += 1
        heapq.heappush(self.events, (t, self.order, kind, data))

    def run(self) -> tuple[list[RequestResult], float]:
        """Every request through the deployment: (results in order, seconds to the last response)."""
        for i, c in enumerate(self.clients):
            if c.arrival < math.inf:
                self._push(c.arrival, "arrive", i)
        budget = MAX_EVENTS_PER_REQUEST * max(1, len(self.clients))
        now = 0.0
        while self.events:
            budget -= 1
            if budget < 0:
                raise RuntimeError("the simulation made no progress (an engine never finishes a request)")
            now, _, kind, data = heapq.heappop(self.events)
            if kind == "arrive":
                if self.cap is not None and self.in_flight >= self.cap:
                    self.blocked.append(data)
                else:
                    self._send(data, now)
            elif kind == "tick":
                e, gen = data
                if gen != e.gen:
                    continue  # retimed: a steady run cut short ends at another event
                e.end_tick(now)
                if e in self.decodes:
                    self._events_of(e)
                self._next(e, now)
            elif kind == "intake":
                self._push(now, "wake", self._route(data, self.clients[data], now))
            elif kind == "wake":
                if not data.running_tick:
                    self._next(data, now)
        unfinished = [i for i, c in enumerate(self.clients) if c.end is None and not c.error]
        for i in unfinished:
            self.clients[i].error = "never scheduled: no engine had room for it"
        end = max((c.end for c in self.clients if c.end is not None), default=0.0)
        return [c.result() for c in self.clients], end

    def _next(self, e: SimEngine, now: float) -> None:
        """Start the engine's next tick if it has work (after its ranks' sends, if any)."""
        if e.running_tick or not e.busy:
            return
        ready = self.stall.pop(id(e), now)
        if ready > now:
            self._push(ready, "wake", e)
            return
        self._push(e.start_tick(now), "tick", (e, e.gen))

    def _retime(self, e: SimEngine, t: float) -> None:
        self._push(t, "tick", (e, e.gen))

    def _send(self, i: int, now: float) -> None:
        c = self.clients[i]
        c.start = now
        self.in_flight += 1
        limit = self.engines[-1].max_model_len
        if len(c.prompt) + c.output_len > limit:
            c.error = (f"HTTP 400: prompt of {len(c.prompt)} tokens + max_tokens {c.output_len} exceeds "
                       f"max_model_len {limit}")
            self._finish(i, now)
            return
        # the engine's next tick starts after every event of the instant the request reaches it
        # (the rank loop takes every request waiting when a tick begins)
        self.intake_free = max(now, self.intake_free) + INTAKE_S
        self._push(self.intake_free, "intake", i)

    def _route(self, i: int, c: Client, now: float) -> SimEngine:
        d = self.d
        if not d.disaggregated:
            loads = [e.unfinished for e in self.engines]
            e, names = self.engines[0], ()
            if len(self.engines) > 1:
                route = self.router.choose(c.prompt, loads, list(range(len(self.engines))))
                self.routed[route.reason] = self.routed.get(route.reason, 0) + 1
                e, names = self.engines[route.replica], route.names  # its blocks' names, hashed once
            e.add(i, c.prompt, c.output_len, now, names=names)
            self.where[i] = e
            return e
        loads = [e.unfinished for e in self.decodes]
        slot = loads.index(min(loads))
        new = uncached_tokens(c.prompt, self.seen[slot], block_size=d.block_size, prefix_caching=d.prefix_caching,
                              remember=False)
        path = choose_path(new, [float(w) for w in self.waiting], min_prompt_tokens=d.min_prompt_tokens,
                           max_prefill_queue=d.max_prefill_queue,
                           colocated=slot >= d.decode_replicas - d.colocated_replicas)
        self.routed[path.reason] = self.routed.get(path.reason, 0) + 1
        dec = self.decodes[slot]
        self.where[i] = dec
        if not path.remote:
            dec.add(i, c.prompt, c.output_len, now)
            return dec
        self.waiting[path.prefill] += 1
        p = self.prefills[path.prefill]
        p.add(i, c.prompt, 1, now)
        self.bound[i] = (p, slot)
        return p

    # -- engine callbacks -----------------------------------------------------------------
    def _chunk(self, seq: Sequence, tokens: int, t: float) -> None:
        c = self.clients[seq.request.index]
        if not c.chunks:
            c.cached_tokens = seq.cached_tokens
        c.chunks.append(t)
        c.tokens += tokens

    def _ended(self, seq: Sequence, t: float) -> None:
        i = seq.request.index
        if i in self.bound and self.bound[i][0] is not self.where[i]:  # its prompt, computed remotely
            self._hand_off(seq, t)
            return
        self._finish(i, t)

    def _hand_off(self, seq: Sequence, t: float) -> None:
        """The prompt's KV to its decode engine; its first token is already out."""
        i = seq.request.index
        p, slot = self.bound.pop(i)
        self.waiting[self.prefills.index(p)] -= 1
        c = self.clients[i]
        if c.output_len <= 1:
            self._finish(i, t)
            return
        g = self.links[self.prefills.index(p)][slot]
        move = send_recv(len(c.prompt) * self.kv_bytes_per_token, self.prefill_tp, g)
        self.stall[id(p)] = max(self.stall.get(id(p), t), t + move)
        req = Request(i, c.prompt, SamplingParams(max_tokens=c.output_len, ignore_eos=True))
        dec = self.decodes[slot]
        dec.hand_over(Sequence(req, None, output=list(seq.output), cached_tokens=seq.cached_tokens), move, t)
        self._next(dec, t)

    def _events_of(self, e: SimEngine) -> None:
        seen = self.seen[self.decodes.index(e)]
        for pool in e.pools():
            for named, name in pool.events:
                (seen.add if named else seen.discard)(name)
            pool.events.clear()

    def _finish(self, i: int, t: float) -> None:
        self.clients[i].end = t
        self.in_flight -= 1
        self.done += 1
        if self.progress is not None:
            self.progress(1)
        if self.blocked:
            self._send(self.blocked.popleft(), t)
        for j in self.next_turns.pop(i, ()):  # the conversation's next turn queues behind those waiting
            if self.clients[i].error:
                self._drop_turn(j, t)
            else:
                self.clients[j].arrival = t
                self._push(t, "arrive", j)

    def _drop_turn(self, j: int, t: float) -> None:
        """A turn whose conversation failed before it: never sent (nor the turns after it)."""
        self.clients[j].error = "an earlier turn of its conversation failed"
        if self.progress is not None:
            self.progress(1)
        for k in self.next_turns.pop(j, ()):
            self._drop_turn(k, t)

    # -- figures --------------------------------------------------------------------------
    def engine_figures(self, duration: float) -> list[dict]:
        """Each engine's busy share, ticks, preemptions, prefix hits and what its steps spent."""
        out = []
        for e in self.engines:
            spent = e.cost.breakdown()
            total = sum(spent.values()) or 1.0
            top = sorted(spent.items(), key=lambda kv: -kv[1])[:3]
            lanes = [s for r in e.replicas for s in r.schedulers]
            out.append({"engine": e.name, "layout": e.layout, "ticks": e.tick_no,
                        "busy_share": e.busy_s / duration if duration > 0 else None,
                        "preemptions": sum(s.preemptions for s in lanes),
                        "num_blocks": sum(s.pool.num_blocks for s in lanes),
                        "bound_by": [{"what": k, "share": v / total} for k, v in top],
                        "spec": dict(e.spec) if e.drafter is not None else None,
                        "prompt_tokens_computed": e.prompt_computed})
        return out

    def tier_counts(self) -> dict[str, dict]:
        """Each KV cache tier's counters over every engine (tiers.figures), writes dropped beside."""
        every = [t for e in self.engines for t in e.tiers]
        out = tier_figures(every)
        if every:
            out["writes_dropped"] = sum(t.dropped for t in every)
        return out
