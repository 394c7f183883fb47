"""EngineCore: the generation loop every rank of a replica runs in lock step, one tick at a
time. A lane's scheduler picks the chunks of the micro-batch entering the pipeline, the
runner moves every micro-batch in flight one stage on, and when one leaves the last stage its
sequences that reached their last token take the sampled token and finished sequences free
their blocks.

Requests join at any tick (`add`) and leave at any tick (`abort`): a waiting or running
sequence frees its blocks at once; one inside a micro-batch in flight (PP) is ended when that
micro-batch leaves the pipeline, since its stages still write its cache. Every rank adds and
aborts the same requests at the same tick (the serving worker broadcasts them), so all agree
on every micro-batch without communication. The rank loop (engine/rank/loop.py) feeds it, as requests come or a fixed list at once.
"""

from __future__ import annotations

import time
from collections import deque

from atoll.engine.spec.registry import make_drafter
from atoll.engine.batch.lanes import Lanes
from atoll.engine.sample.micro_batch import MicroBatch, prompt_positions
from atoll.engine.batch.request import Request, finish_reason, result_of
from atoll.engine.sample.sampler import SamplerState, logprob_entry, prompt_logprob_entry
from atoll.engine.sample.tree import kept_path
from atoll.engine.batch.scheduler import Sequence
from atoll.engine.batch.shape import step_shape
from atoll.engine.batch.tokenizer import Tokenizer


class EngineCore:
    """One rank's lanes, micro-batches in flight and results. Callbacks (all optional):
    `on_finish(index, result)` as a request ends; `on_token(seq, started)` on every rank as a
    sequence takes a token, before its blocks can be freed (disaggregation); `inbox.poll(tick,
    lanes)` gives (sequence, started) pairs whose prompt arrived already in the cache, and
    `inbox.pending` keeps the loop going while more are to come. `trace`: a list that takes,
    for every tick with work in flight, (engine.batch.shape.StepShape of its heaviest
    micro-batch, the tick's seconds on this rank), as `atoll calibrate --steps` fits them."""

    def __init__(self, runner, *, pipelined: bool = True, stop_strings: bool = False, on_finish=None,
                 on_token=None, inbox=None, trace: list | None = None):
        spec = self.spec = runner.spec
        self.runner = runner
        self.depth = runner.ctx.layout.pp
        # speculative decoding (engine.spec.registry, engine.sample.verify): None when off
        self.drafter = make_drafter(spec.engine.speculative_config, runner, max_model_len=spec.max_model_len)
        self.spec_totals = {"steps": 0, "drafted": 0, "accepted": 0}  # verify steps of a sequence, tokens
        self.lanes = Lanes(num_blocks=runner.num_blocks, block_size=spec.engine.block_size,
                           max_num_seqs=spec.engine.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
                           max_model_len=spec.max_model_len, depth=self.depth, pipelined=pipelined,
                           prefix_caching=spec.engine.enable_prefix_caching, drafter=self.drafter,
                           sliding_window=runner.config.pool_window, cp=runner.ctx.layout.cp,
                           window_pool=runner.window_pool, tiers=runner.kv_tiers)
        self.inflight: deque[MicroBatch | None] = deque()  # inflight[s]: the micro-batch at stage s
        self.results: dict[int, dict] = {}
        self.tick, self.produced = 0, 0
        self.started: dict[int, float] = {}
        self.sequences: dict[int, Sequence] = {}  # index -> its sequence, until it ends
        self.tokens: list[tuple] = []  # (index, token, logprobs) taken since the caller last drained them
        self.on_finish, self.on_token, self.inbox = on_finish, on_token, inbox
        self._decode = Tokenizer(spec.model_dir).decode if stop_strings else None
        self._aborting: set[int] = set()  # indices to end when their micro-batch leaves the pipeline
        self.trace = trace

    def add(self, req: Request) -> None:
        """The request joins this tick (every rank adds it at the same tick)."""
        if req.params.stop and self._decode is None:  # the first request with stop strings
            self._decode = Tokenizer(self.spec.model_dir).decode
        seq = Sequence(req, SamplerState(req.params, self.runner.device, prompt=req.prompt_token_ids,
                                         grammars=self.runner.grammars),
                       arrived_step=self.tick)
        self.sequences[req.index] = seq
        self.started[req.index] = time.perf_counter()
        if req.generated:  # it goes on from the tokens it generated elsewhere
            seq.output = list(req.generated)
            reason = finish_reason(seq, self.spec.max_model_len, self._decode)
            if reason is not None:  # it had ended there: nothing to compute
                self.lanes.add(seq)
                self._end(seq, reason)
                return
        leader = self.sequences.get(req.fork_of) if req.fork_of is not None else None
        if leader is not None and self._parks(leader):  # a copy: forked once the leader's prompt is computed
            seq.leader = leader
            leader.followers.append(seq)
            return
        self.lanes.add(seq)

    def _parks(self, leader: Sequence) -> bool:
        """Whether a copy can still wait on `leader`: it leads (is not itself parked), has no
        token yet, and no chunk that draws its first token is in flight (that chunk's width
        was fixed as it entered)."""
        return (leader.leader is None and not leader.output
                and not any(mb is not None and any(c.seq is leader and c.samples for c in mb.chunks)
                            for mb in self.inflight))

    def abort(self, index: int) -> bool:
        """End request `index` as "abort": its blocks go back now, or when the micro-batch
        holding it leaves the pipeline. False if it is not running here."""
        seq = self.sequences.get(index)
        if seq is None:
            return False
        if seq.leader is not None:  # a parked copy: it leaves its leader's list
            seq.leader.followers.remove(seq)
            seq.leader = None
            self._end(seq, "abort")
        elif any(mb is not None and any(c.seq is seq for c in mb.chunks) for mb in self.inflight):
            self._aborting.add(index)
        else:
            self._end(seq, "abort")
        return True

    @property
    def busy(self) -> bool:
        return bool(self.lanes.has_work() or any(b is not None for b in self.inflight)
                    or (self.inbox is not None and self.inbox.pending))

    def step(self, *, more: bool = False) -> bool:
        """One tick, if there is work here (or `more` to come) or another DP replica has some.
        Returns whether a tick ran; False on every rank of the job together (runner.agree)."""
        runner = self.runner
        if self.inbox is not None:
            for seq, at in self.inbox.poll(self.tick, self.lanes):
                self.sequences[seq.request.index] = seq
                self.started[seq.request.index] = at
                self._settle(seq)
        if runner.kv_tiers is not None:  # the tiers' reads every rank has finished
            runner.kv_tiers.poll()
        started = time.perf_counter()
        lane = self.lanes.at(self.tick)
        chunks = lane.schedule(self.tick) if lane is not None else []
        mb = MicroBatch.of(chunks, self.spec.engine.block_size, device=runner.device) if chunks else None
        if runner.kv_tiers is not None:  # blocks brought up from the lower tiers, into the cache
            runner.kv_tiers.apply()
            if mb is not None:
                mb.tier_saves = runner.kv_tiers.take_new()
            elif not any(b is not None for b in self.inflight):  # nothing to compute: wait for a read
                runner.kv_tiers.idle()
        go, mb = runner.agree(more or self.busy, mb)
        if not go:
            return False
        self.inflight.appendleft(mb)
        if self.trace is not None:  # the heaviest micro-batch in flight sets the tick (one, without PP)
            size, step = self.spec.engine.block_size, runner.decode_step
            shapes = [step_shape(b.chunks, size, -(-self.spec.max_model_len // size),
                                 step.buckets if step is not None else None)
                      for b in self.inflight if b is not None]
            heaviest = max(shapes, key=lambda x: (x.chunk_tokens, x.rows), default=None)
        tokens = runner.tick(self.inflight)
        if len(self.inflight) == self.depth and (done := self.inflight.pop()) is not None:
            rows, prompt_rows = runner.logprobs, runner.prompt_logprobs
            self._apply(done, tokens.tolist(), rows.tolist() if rows is not None else None,
                        prompt_rows.tolist() if prompt_rows is not None else None)
        if self.trace is not None and heaviest is not None:
            self.trace.append((heaviest, time.perf_counter() - started, runner.last_graphed, started))
        self.tick += 1
        return True

    def drain(self) -> list[tuple]:
        """The (index, token, logprobs, prompt logprobs) taken since the last drain, in order;
        logprobs is None unless the request asked (and this rank is its replica's leader):
        {"logprob", "top"}; prompt logprobs likewise, with a request's first token only:
        [None, {"token", "logprob", "rank", "top"}, ...] (engine.sample.sampler)."""
        out, self.tokens = self.tokens, []
        return out

    def _apply(self, mb: MicroBatch, tokens: list, logprobs: list | None = None,
               prompt_rows: list | None = None) -> None:
        """The micro-batch's chunks are in the cache; sampling ones take their token (a chunk
        that drew for parked copies forks them first: engine.batch.scheduler's fork)."""
        now = time.perf_counter()
        if prompt_rows is not None:
            self._take_prompt_logprobs(mb, prompt_rows)
        widest = mb.logprobs_k
        for i, (c, row) in enumerate(zip(mb.chunks, tokens)):
            seq = c.seq
            taken = [t for t in row if t >= 0] if isinstance(row, list) else [row]
            seq.cached = c.start + c.count
            if c.draft:  # the accepted drafts stay in the cache; the rejected ones' blocks go back
                accepted = max(len(taken) - 1, 0)
                self.drafter.observe(seq, c.draft, row)
                seq.cached -= len(c.draft) - accepted
                if c.parents is not None:  # a tree: the kept path's keys into contiguous slots first
                    c.path = kept_path(c.parents, [seq.tokens[-1], *c.draft], taken)
                    self.runner.compact(seq.blocks, c.start, c.path)
                self.lanes.schedulers[seq.lane].pool.trim(seq.blocks, seq.cached)
                seq.spec_steps += 1
                seq.spec_drafted += len(c.draft)
                seq.spec_accepted += accepted
                for key, n in (("steps", 1), ("drafted", len(c.draft)), ("accepted", accepted)):
                    self.spec_totals[key] += n
            index = seq.request.index
            if index in self._aborting:
                self._aborting.discard(index)
                self._end(seq, "abort")
                continue
            if not c.samples:
                continue  # a prefill chunk short of the last prompt token
            k = seq.request.params.logprobs
            copies = []
            if seq.followers:  # n > 1: one token drawn for each parked copy, which forks now
                copies, seq.followers, taken = seq.followers, [], taken[:1]
                blocks = []
                for j, copy in enumerate(copies):
                    copy.leader = None
                    copy.prompt_logprobs = list(seq.prompt_logprobs)
                    blocks += self.lanes.fork(seq, copy, self.tick)
                self.runner.copy_blocks(blocks, self.drafter)
            for token in taken:  # one token, or a verify step's accepted drafts and the target's own
                lp = logprob_entry(logprobs[i], k, widest) if logprobs and k is not None else None
                if not self._take(seq, token, lp, now):
                    break  # it ended: the tokens after its last are dropped
            for j, copy in enumerate(copies):
                lp = logprob_entry(logprobs[i], k, widest, 1 + j) if logprobs and k is not None else None
                self._take(copy, row[1 + j], lp, now)

    def _take(self, seq: Sequence, token: int, logprobs, now: float) -> bool:
        """The sequence takes one token; False once it has ended."""
        index = seq.request.index
        if index not in self.sequences:
            return False
        seq.output.append(token)
        self.produced += 1
        prompt, first = None, seq.first_token_at is None  # its first token here (after a migration: not its first)
        if first and seq.request.params.prompt_logprobs is not None:
            prompt = [None] + seq.prompt_logprobs
        self.tokens.append((index, token, logprobs, prompt))
        if first:
            seq.first_token_at = now
        if self.on_token is not None:
            self.on_token(seq, self.started[index])
        self._settle(seq)
        return index in self.sequences

    def _take_prompt_logprobs(self, mb: MicroBatch, rows: list) -> None:
        """Each prompt chunk's rows, in order (MicroBatch.sample): the entry of prompt token q + 1
        for each position q, kept once (a recomputed prompt gives the same rows again)."""
        widest, at = mb.prompt_logprobs_k, 0
        for c in mb.chunks:
            seq = c.seq
            for q in prompt_positions(c):
                if q == len(seq.prompt_logprobs):
                    token = seq.request.prompt_token_ids[q + 1]
                    seq.prompt_logprobs.append(prompt_logprob_entry(rows[at], token, seq.request.params.prompt_logprobs,
                                                                    widest))
                at += 1

    def _settle(self, seq: Sequence) -> None:
        """End the sequence if its last token finishes it."""
        reason = finish_reason(seq, self.spec.max_model_len, self._decode) if seq.output else None
        if reason is not None:
            self._end(seq, reason)

    def _end(self, seq: Sequence, reason: str) -> None:
        index = seq.request.index
        if seq.followers:  # it leaves before its first token: its first copy leads the rest
            first, *rest = seq.followers
            seq.followers, first.leader, first.followers = [], None, rest
            for copy in rest:
                copy.leader = first
            self.lanes.add(first)
        self.lanes.end(seq)
        self.sequences.pop(index, None)
        self.results[index] = result_of(seq, reason, self.started[index], time.perf_counter(), self.tick)
        if self.drafter is not None:
            self.drafter.forget(seq)
            self.results[index]["metrics"] |= {"spec_steps": seq.spec_steps, "spec_drafted": seq.spec_drafted,
                                               "spec_accepted": seq.spec_accepted}
        if self.on_finish is not None:
            self.on_finish(index, self.results[index])

    def blocks_in_use(self) -> int:
        """KV blocks held by sequences (named blocks no sequence holds are free to evict)."""
        return sum(s.pool.num_blocks - s.pool.num_free for s in self.lanes.schedulers)

    def window_stats(self) -> dict:
        """The sliding layers' own blocks (engine.kv.windowed), held and in all; {} without them."""
        pools = [s.pool.window for s in self.lanes.schedulers if hasattr(s.pool, "window")]
        if not pools:
            return {}
        return {"window_blocks_in_use": sum(p.num_blocks - p.num_free for p in pools),
                "window_num_blocks": sum(p.num_blocks for p in pools)}

    def cached_blocks(self) -> int:
        return sum(s.pool.num_cached for s in self.lanes.schedulers)
