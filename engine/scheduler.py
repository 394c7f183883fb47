"""Continuous batching: every step admits waiting requests within max_num_seqs and
max_num_batched_tokens, mixes prefill chunks with decode tokens, and when the KV blocks run
out preempts the newest running sequence (its blocks are freed and it is recomputed later).

Fairness: waiting requests are admitted strictly in arrival order and a preempted sequence
goes back to the head of the queue, while preemption always takes the newest running
sequence, so the oldest request always makes progress: nothing starves.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from atoll.engine.blocks import BlockPool
from atoll.engine.sampling import SamplerState


@dataclass(eq=False)  # a sequence is itself: compared by identity
class Sequence:
    request: object  # engine.generate.Request
    state: SamplerState
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    cached: int = 0  # positions already in the KV cache
    arrived_step: int = 0
    first_scheduled_step: int | None = None
    first_token_at: float | None = None
    preemptions: int = 0
    lane: int = 0  # which scheduler holds it under pipelined decode

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_token_ids + self.output

    @property
    def remaining(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.output) - self.cached


@dataclass
class Scheduled:
    seq: Sequence
    start: int  # first position computed this step
    count: int  # positions computed this step

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token, so its logits give the next token."""
        return self.start + self.count == len(self.seq.tokens)


class Scheduler:
    def __init__(self, pool: BlockPool, *, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, victim: Sequence) -> None:
        self.running.remove(victim)
        self.pool.release(victim.blocks)
        victim.cached = 0  # recompute: prompt and output so far are prefilled again
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(victim)

    def schedule(self, step: int) -> list[Scheduled]:
        out: list[Scheduled] = []
        budget = self.budget
        # running sequences first, oldest first; each needs its next chunk (1 token when decoding)
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted below by an older sequence
            count = min(seq.remaining, budget)
            if count == 0:
                continue
            while not self.pool.grow(seq.blocks, seq.cached + count):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            out.append(Scheduled(seq, seq.cached, count))
            budget -= count
        # then waiting sequences, strictly in order
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            count = min(seq.remaining, budget)
            if not self.pool.grow(seq.blocks, seq.cached + count):
                break  # head of line waits for blocks; later ones do not jump ahead
            self.waiting.popleft()
            self.running.append(seq)
            self.running.sort(key=lambda s: (s.arrived_step, s.request.index))  # oldest first
            if seq.first_scheduled_step is None:
                seq.first_scheduled_step = step
            out.append(Scheduled(seq, seq.cached, count))
            budget -= count
        return out

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.release(seq.blocks)
