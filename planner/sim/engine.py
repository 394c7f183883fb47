"""One simulated engine: atoll's own lanes, scheduler and block pools (engine.batch, engine.kv)
ticking as the rank loop ticks them (engine/rank/core.py: EngineCore.step), each tick timed by
the cost model (clock.py) instead of run by ranks.

A tick schedules the lane whose micro-batch enters the pipeline, with every DP replica of the
engine doing the same in lock step; the micro-batch leaves the last stage `pp` ticks later and
its sampling chunks take their token then. A tick lasts as long as its slowest micro-batch in
flight takes in its stage (with one stage: the whole pass). A request that arrives during a
tick joins at the next, as the rank loop reads its feed between ticks.

Tokens: a simulated sequence samples stand-in token ids that are distinct per request and
position (so no two requests share a generated block by accident); the prompt's are its own.
Speculative decoding uses the engine's own Drafter (engine.spec.drafter: which chunks get a
draft, its length, its blocks); each drafted token is kept with probability `acceptance`
until the first rejected one, as a verify step keeps the longest agreeing run.

KV cache tiers (tiers.py): each DP replica's lanes share one SimTiers, which reads a prompt's
blocks on the clock; a tick with nothing to compute while reads are out lasts until the first
ends, or IDLE_WAIT_S at most, as the rank loop waits on its reads.
"""

from __future__ import annotations

import random

from atoll.config.sampling import SamplingParams
from atoll.config.speculative import SpeculativeConfig
from atoll.engine.batch.lanes import Lanes
from atoll.engine.batch.request import Request, finish_reason
from atoll.engine.batch.scheduler import Sequence
from atoll.engine.batch.shape import seq_buckets, step_shape
from atoll.engine.spec.drafter import Drafter
from atoll.layers.context_groups import context_groups
from atoll.planner.sim import steady

IDLE_WAIT_S = 1e-3  # engine/rank/tier_reads.py: Reads.idle's wait for a read on an empty tick


def token_at(index: int, position: int) -> int:
    """The stand-in token a simulated request samples at `position`."""
    return (index * 1_000_003 + position * 7_919) % 2_000_000_011


class SimDrafter(Drafter):
    """Drafts `k` stand-in tokens for a chunk with probability `draft_rate` (1: every decode
    step; an n-gram drafter drafts only where its lookup finds a match)."""

    method = "simulated"

    def __init__(self, k: int, *, draft_rate: float, max_model_len: int, seed: int):
        super().__init__(SpeculativeConfig(method="ngram", num_speculative_tokens=k), max_model_len=max_model_len)
        self.rate, self.rng = draft_rate, random.Random(seed)

    def propose(self, wants: list[tuple]) -> list[list[int]]:
        return [[0] * k if self.rng.random() < self.rate else [] for _, k in wants]


class SimEngine:
    """An engine of `dp` replicas in lock step, each with its own Lanes (pp lanes when
    pipelined), timed by `cost` (a clock.StepCost). Callbacks: on_chunk(seq, tokens, t) as a
    sequence takes tokens at time t, on_end(seq, t) as it ends, on_retime(engine, t) when the
    tick under way now ends at t instead (a run of steady ticks cut short: steady.py). fast:
    fast-forward steady decode (steady.py; False ticks one by one, for the tests' comparison).
    tiers: make_tiers(clock) gives a DP replica's KV cache tiers (tiers.SimTiers), or None."""

    def __init__(self, name: str, cost, *, layout: str = "TP1", num_blocks: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, pp: int = 1, dp: int = 1,
                 prefix_caching: bool = False, spec_k: int = 0, acceptance: float = 0.0, draft_rate: float = 1.0,
                 seed: int = 0, on_chunk=None, on_end=None, on_retime=None, fast: bool = True, tiers=None):
        self.name, self.layout, self.cost, self.depth, self.max_model_len = name, layout, cost, pp, max_model_len
        # the compiled decode step's shapes: rows in buckets, tables in powers of two of blocks
        self.block_size, self.max_blocks = block_size, -(-max_model_len // block_size)
        self.buckets = seq_buckets(max_num_seqs * (1 + spec_k))
        # a measured step that timed the eager step's decode ticks apart (stepfit.StepFit.eager_decode)
        fit = getattr(cost, "fit", None)
        self.eager_decode = fit is not None and fit.eager_decode
        self.drafter = (SimDrafter(spec_k, draft_rate=draft_rate, max_model_len=max_model_len, seed=seed)
                        if spec_k else None)
        self.acceptance, self.rng = acceptance, random.Random(seed + 1)
        self.now = 0.0  # the tick being scheduled (the tiers' clock)
        self.tiers = [tiers(lambda: self.now) for _ in range(dp)] if tiers is not None else []
        self.replicas = [Lanes(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, depth=pp,
                               prefix_caching=prefix_caching, drafter=self.drafter,
                               tiers=self.tiers[i] if self.tiers else None) for i in range(dp)]
        self.prompt_computed = 0  # prompt tokens the ticks computed (recomputed ones again)
        self.inflight: list = []  # [(per-replica chunk lists, pass seconds, stage seconds)], newest first
        self.tick_no = 0
        self.busy_s = 0.0
        self.running_tick = False  # a tick is under way (its end is an event)
        self.adopting: list = []  # sequences computed elsewhere, waiting for room (disaggregation)
        self.adopted_extra_s = 0.0  # this tick's KV receive time
        self.on_chunk, self.on_end, self.on_retime = on_chunk, on_end, on_retime
        self.fast = fast
        self.run: steady.Run | None = None  # the steady ticks under way, if any
        self.gen = 0  # bumped when the tick under way is retimed: older end events are stale
        self.unfinished = 0
        self.replica_of: dict[int, int] = {}  # request index -> the DP replica that holds it
        self.spec = {"steps": 0, "drafted": 0, "accepted": 0}

    # -- requests -------------------------------------------------------------------------
    def add(self, index: int, prompt: list[int], output_len: int, now: float | None = None,
            names: tuple = ()) -> Sequence:
        """A request arriving at `now` (it joins at the next tick); names: its prompt's full
        blocks' names where the router computed them already (the scheduler's own hash chain)."""
        step = self._interrupt(now)
        req = Request(index, prompt, SamplingParams(max_tokens=output_len, ignore_eos=True))
        seq = Sequence(req, None, arrived_step=step, names=list(names))
        self.replicas[self._least_loaded(index)].add(seq)
        self.unfinished += 1
        return seq

    def _least_loaded(self, index: int) -> int:
        """The DP replica with the fewest unfinished sequences (the driver's choice), now request index's."""
        loads = [sum(len(s.waiting) + len(s.running) for s in r.schedulers) for r in self.replicas]
        self.replica_of[index] = loads.index(min(loads))
        return self.replica_of[index]

    def hand_over(self, seq: Sequence, receive_s: float, now: float | None = None) -> None:
        """A sequence whose prompt another engine computed (its first token in output): it
        joins once a lane has room, the tick that adopts it taking receive_s longer."""
        self._interrupt(now)
        self.adopting.append((seq, receive_s))
        self.unfinished += 1

    def _interrupt(self, now: float | None) -> int:
        """Something new for the engine at `now`: a steady run under way stops after its tick
        then running. Returns the tick number under way."""
        if self.run is None or now is None:
            return self.tick_no
        step = self.tick_no + self.run.running_tick(now)
        dropped = self.run.cut(now)
        if dropped is not None:
            self.busy_s -= dropped
            self.gen += 1
            if self.on_retime is not None:
                self.on_retime(self, self.run.ends[-1])
        return step

    @property
    def busy(self) -> bool:
        return bool(self.adopting or any(r.has_work() for r in self.replicas)
                    or any(mb is not None for mb in self.inflight))

    def pools(self):
        return [s.pool for r in self.replicas for s in r.schedulers]

    # -- ticks ----------------------------------------------------------------------------
    def start_tick(self, now: float) -> float:
        """Schedule this tick's micro-batch; returns when the tick ends."""
        self.now = now
        extra = self._adopt(now)
        chunks = []
        for r in self.replicas:
            lane = r.at(self.tick_no)
            chunks.append(lane.schedule(self.tick_no) if lane is not None else [])
        entry = None
        if any(chunks):
            entry = (chunks, *self._cost(chunks))
            for part in chunks:
                for c in part:
                    self.prompt_computed += max(0, min(c.start + c.count, len(c.seq.request.prompt_token_ids))
                                                - c.start)
        self.inflight.insert(0, entry)
        live = [e for e in self.inflight if e is not None]
        if self.depth == 1:
            dt = live[0][1] if live else 0.0
        else:
            dt = max((e[2] for e in live), default=0.0)
        if not live and self.tiers:  # nothing to compute: wait on the reads out, if any
            done = min((d for t in self.tiers if (d := t.next_done()) is not None), default=None)
            if done is not None:
                dt = min(max(0.0, done - now), IDLE_WAIT_S)
        dt += extra
        self.busy_s += dt if live else extra
        self.running_tick = True
        self.run = steady.plan(self, chunks, now, dt) if entry is not None else None
        if self.run is not None:
            self.busy_s += sum(s for s, _ in self.run.costs)
            return self.run.ends[-1]
        return now + dt

    def end_tick(self, t: float) -> None:
        """The tick ends at t: the micro-batch leaving the last stage takes its tokens."""
        self.running_tick = False
        if self.run is not None:  # tick 0's micro-batch, then the steady ticks after it
            run, self.run = self.run, None
            done = self.inflight.pop()
            steady.settle(self, run, lambda t0: [self._apply(c, t0) for part in done[0] for c in part])
            self.tick_no += run.ticks
            return
        if len(self.inflight) == self.depth:
            done = self.inflight.pop()
            if done is not None:
                for chunks in done[0]:
                    for c in chunks:
                        self._apply(c, t)
        self.tick_no += 1

    def _cost(self, chunks: list[list]) -> tuple[float, float]:
        shapes = [step_shape(part, self.block_size, self.max_blocks, self.buckets) for part in chunks]
        multi = len(shapes) > 1
        split = self.eager_decode and not any(x.chunk_tokens for x in shapes) and self.splits(chunks)
        pass_s, stage_s, key = self.cost.tick(
            sum(x.rows for x in shapes), sum(x.chunk_tokens for x in shapes), sum(x.ctx_sum for x in shapes),
            sum(x.attended_sum for x in shapes), dp_rows=max(x.rows for x in shapes) if multi else None,
            dp_chunk_tokens=max(x.chunk_tokens for x in shapes) if multi else None,
            ctx_padded=sum(x.ctx_padded for x in shapes), split=split)
        self.cost.count(key)
        return pass_s, stage_s

    def splits(self, chunks: list[list], ahead: int = 0) -> bool:
        """Whether a decode-only tick's rows (each `ahead` positions further on) split into
        context groups in any replica, so the compiled CPU step leaves the tick to the eager step."""
        size = self.block_size
        return any(context_groups([c.start + ahead for c in part], size) is not None for part in chunks if part)

    def _adopt(self, now: float) -> float:
        """Sequences handed over, in order, while a lane has room; the KV receive time they add."""
        extra = 0.0
        while self.adopting:
            seq, receive_s = self.adopting[0]
            seq.arrived_step = self.tick_no
            if not self.replicas[self._least_loaded(seq.request.index)].adopt(seq, self.tick_no):
                break
            self.adopting.pop(0)
            extra += receive_s
            if self._finished(seq):  # one output token: done with the prefill engine's
                self._end(seq, now)
        return extra

    def _apply(self, c, t: float) -> None:
        seq = c.seq
        seq.cached = c.start + c.count
        taken = 1
        if c.draft:
            accepted = 0
            while accepted < len(c.draft) and self.rng.random() < self.acceptance:
                accepted += 1
            seq.cached -= len(c.draft) - accepted
            self.replicas[self.replica_of[seq.request.index]].schedulers[seq.lane].pool.trim(seq.blocks, seq.cached)
            taken += accepted
            for k, n in (("steps", 1), ("drafted", len(c.draft)), ("accepted", accepted)):
                self.spec[k] += n
        if not c.samples:
            return
        if taken == 1:  # one token, the common case: finish_reason's test, inline
            seq.output.append(token_at(seq.request.index, seq.length))
            p = seq.request.params
            finished = (seq.output[-1] in p.stop_token_ids or len(seq.output) >= p.max_tokens
                        or seq.length >= self.max_model_len)
            if self.on_chunk is not None:
                self.on_chunk(seq, 1, t)
            if finished:
                self._end(seq, t)
            return
        tokens, finished = 0, False
        while tokens < taken and not finished:
            seq.output.append(token_at(seq.request.index, seq.length))
            tokens += 1
            finished = finish_reason(seq, self.max_model_len) is not None
        if self.on_chunk is not None:
            self.on_chunk(seq, tokens, t)
        if finished:
            self._end(seq, t)

    def take(self, seq: Sequence, t: float) -> None:
        """A steady tick's token for seq at t (steady.settle: it never ends the sequence)."""
        seq.output.append(token_at(seq.request.index, seq.length))
        if self.on_chunk is not None:
            self.on_chunk(seq, 1, t)

    def _finished(self, seq: Sequence) -> bool:
        return bool(seq.output) and finish_reason(seq, self.max_model_len) is not None

    def _end(self, seq: Sequence, t: float) -> None:
        self.replicas[self.replica_of.pop(seq.request.index)].end(seq)
        self.unfinished -= 1
        if self.on_end is not None:
            self.on_end(seq, t)

    # -- figures --------------------------------------------------------------------------
    def blocks(self) -> tuple[int, int]:
        """(blocks in use, blocks in all) over the engine's pools."""
        pools = self.pools()
        return sum(p.num_blocks - p.num_free for p in pools), sum(p.num_blocks for p in pools)
