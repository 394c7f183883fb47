"""Continuous batching: every step admits waiting requests within max_num_seqs and
max_num_batched_tokens, mixes prefill chunks with decode tokens, and when the KV blocks run
out preempts the newest running sequence (its blocks are freed and it is recomputed later).

Prefix caching (engine.kv.blocks): a sequence admitted from the queue first takes every cached
full block that starts its tokens and is prefilled from the first token after them. It never
takes the block holding its last token, which must be computed to sample the next one, so a
block is only ever written by the sequence that computes it. A chunk's full blocks are named
as it is scheduled: a sequence admitted later in the same step already shares them, since
each layer writes the step's keys and values into the cache before any sequence attends (and
a chunk once scheduled is always computed: preemption only takes sequences not yet scheduled
in the step). A preempted sequence may find its own blocks again when it comes back.

Fairness: waiting requests are admitted strictly in arrival order and a preempted sequence
goes back to the head of the queue, while preemption always takes the newest running
sequence, so the oldest request always makes progress: nothing starves.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from atoll.engine.kv.blocks import BlockPool, block_hash


@dataclass(eq=False)  # a sequence is itself: compared by identity
class Sequence:
    request: object  # engine.batch.request.Request
    state: object  # its sampler's state (engine.sample.sampler.SamplerState); None where nothing samples
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    cached: int = 0  # positions already in the KV cache
    arrived_step: int = 0
    first_scheduled_step: int | None = None
    first_token_at: float | None = None
    preemptions: int = 0
    lane: int = 0  # which scheduler holds it under pipelined decode
    cached_tokens: int = 0  # prompt tokens found in the prefix cache when first admitted
    names: list[bytes] = field(default_factory=list)  # names of its first full blocks of tokens
    named: int = 0  # leading blocks of `blocks` already named (or found) in the pool
    slid: int = 0  # leading blocks a sliding window has passed, let go of (BlockPool.free_before)
    spec_steps: int = 0  # speculative verify steps it took part in (engine.sample.verify)
    spec_drafted: int = 0  # tokens drafted for it
    spec_accepted: int = 0  # drafted tokens the target kept
    draft_cached: int = 0  # positions a draft model's own cache computed for it (engine.spec.registry)
    # n > 1 (engine.batch.copies): the copies parked on this sequence until its prompt is
    # computed, each then forked from it (Scheduler.fork); a parked copy's `leader`
    followers: list = field(default_factory=list)
    leader: "Sequence | None" = None
    prompt_logprobs: list = field(default_factory=list)  # entries for prompt positions 1, 2, ... as computed

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_token_ids + self.output

    @property
    def length(self) -> int:
        """len(tokens), without building them."""
        return len(self.request.prompt_token_ids) + len(self.output)

    @property
    def remaining(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.output) - self.cached


@dataclass
class Scheduled:
    seq: Sequence
    start: int  # first position computed this step
    count: int  # positions computed this step, drafted tokens included
    draft: list[int] = field(default_factory=list)  # speculative tokens after the sequence's last one
    # a tree draft (engine.sample.tree): the parent of each of [pending token] + draft, -1 first;
    # None: a chain. path: the drafted nodes the verify kept, in order (set when it is applied)
    parents: list[int] | None = None
    path: list[int] | None = None

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token, so its logits give the next token."""
        return self.start + self.count - len(self.draft) == self.seq.length

    @property
    def token_ids(self) -> list[int]:
        """The ids of the chunk's positions: the sequence's tokens, then its draft."""
        return self.seq.tokens[self.start:self.start + self.count - len(self.draft)] + self.draft


LOADING = object()  # _admit's answer for a sequence whose blocks the KV tiers are reading


class Scheduler:
    def __init__(self, pool: BlockPool, *, max_num_seqs: int, max_num_batched_tokens: int,
                 prefix_caching: bool = False, drafter=None, sliding_window: int | None = None, tiers=None):
        """drafter: proposes speculative tokens for decoding sequences (engine.spec.registry), or None.
        sliding_window: every layer attends to this many positions at most (Mistral): blocks
        wholly before a running sequence's window go back to the pool (the pool needs a hole).
        With a WindowedPool (engine.kv.windowed) it is the sliding layers' widest window, and
        only their blocks go back.
        tiers: the KV cache's lower tiers (engine.rank.kv_tiers.RankTiers), with prefix caching:
        `held(seq, names)` the leading blocks they hold and have read for the sequence (every
        rank the same count), or None while they are still reading them (the sequence waits
        in `loading`, the others go on; `ready(seq)` says when to try it again); `fill(block,
        i)` the block that takes the i-th; `computed(block, name, parent)` a block named this
        tick; `cancel(seq)` a loading sequence left."""
        self.pool = pool
        self.tiers = tiers if prefix_caching else None
        self.window = sliding_window if pool.hole is not None else None
        self.drafter = drafter
        self.prefix_caching = prefix_caching
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.loading: list[Sequence] = []  # waiting for their blocks from the KV tiers
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        if not seq.blocks:
            seq.blocks = self.pool.table()  # the pool's kind of table (engine.kv.windowed)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def _names(self, seq: Sequence, blocks: int) -> list[bytes]:
        """The names of the sequence's first `blocks` full blocks of tokens (kept: tokens only grow)."""
        size, tokens = self.pool.block_size, seq.tokens
        while len(seq.names) < blocks:
            i = len(seq.names)
            seq.names.append(block_hash(seq.names[-1] if i else None, tokens[i * size:(i + 1) * size]))
        return seq.names[:blocks]

    def commit(self, chunk: Scheduled) -> Scheduled:
        """Name the sequence's blocks that the chunk fills (with its real tokens: never a draft)."""
        seq, full = chunk.seq, (chunk.start + chunk.count - len(chunk.draft)) // self.pool.block_size
        if self.prefix_caching and full > seq.named:
            names = self._names(seq, full)
            for i in range(seq.named, full):
                self.pool.name_at(seq.blocks, i, names[i])
                if self.tiers is not None:
                    self.tiers.computed(seq.blocks[i], names[i], names[i - 1] if i else None)
            seq.named = full
        return chunk

    def _admit(self, seq: Sequence, budget: int) -> Scheduled | None:
        """A waiting sequence's first chunk, after the cached blocks that start it; None (and no
        change) if the blocks it needs are not free."""
        pool, hits, below = self.pool, [], 0
        # never the block of the last token: it is computed to sample; nor for a request that asks
        # for its prompt's logprobs, which are computed from every prompt position (as vLLM skips)
        if self.prefix_caching and seq.request.params.prompt_logprobs is None:
            names = self._names(seq, (seq.length - 1) // pool.block_size)
            hits = pool.lookup(names)
            if self.tiers is not None and len(hits) < len(names):
                below = self.tiers.held(seq, names[len(hits):])  # brought up from the lower tiers
                if below is None:
                    return LOADING
        start = (len(hits) + below) * pool.block_size
        count = min(seq.length - start, budget)
        if not pool.fits(hits, start + count):
            return None
        pool.share(seq.blocks, hits)
        pool.grow(seq.blocks, start + count)
        for i in range(len(hits), len(hits) + below):
            self.tiers.fill(seq.blocks[i], i - len(hits))
            pool.name_at(seq.blocks, i, names[i])
        seq.cached, seq.named = start, len(hits) + below
        if seq.first_scheduled_step is None:
            seq.cached_tokens = start
        return self.commit(Scheduled(seq, start, count))

    def _slide(self, seq: Sequence) -> None:
        """Let go of the blocks the sequence's window has passed: its next query is at position
        seq.cached and reads keys after seq.cached - window, so every block ending at or
        before seq.cached - window + 1 is read no more (named ones stay cached)."""
        dead = (seq.cached - self.window + 1) // self.pool.block_size
        if dead > seq.slid:
            self.pool.free_before(seq.blocks, dead)
            seq.slid = dead

    def _preempt(self, victim: Sequence) -> None:
        self.running.remove(victim)
        self.pool.release(victim.blocks)
        victim.cached = victim.named = victim.slid = 0  # recompute: prompt and output so far are prefilled again
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(victim)

    def schedule(self, step: int) -> list[Scheduled]:
        out: list[Scheduled] = []
        budget = self.budget
        # running sequences first, oldest first; each needs its next chunk (1 token when decoding)
        gone: set[Sequence] = set()  # preempted this step (a set: a running list may be long)
        for seq in list(self.running):
            if seq in gone:
                continue  # preempted below by an older sequence
            count = min(seq.remaining, budget)
            if count == 0:
                continue
            if self.window:
                self._slide(seq)
            while not self.pool.grow(seq.blocks, seq.cached + count):
                victim = self.running[-1]
                self._preempt(victim)
                gone.add(victim)
                if victim is seq:
                    break
            if seq in gone:
                continue
            out.append(self.commit(Scheduled(seq, seq.cached, count)))
            budget -= count
        if self.drafter is not None:
            budget -= self.drafter.extend(out, self.pool, budget, running=len(self.running))
        # sequences whose blocks the tiers have read go back to the head of the line
        for seq in [s for s in self.loading if self.tiers.ready(s)][::-1]:
            self.loading.remove(seq)
            self.waiting.appendleft(seq)
        # then waiting sequences, strictly in order (one whose blocks are being read steps aside)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            chunk = self._admit(seq, budget)
            if chunk is LOADING:
                self.loading.append(self.waiting.popleft())
                continue
            if chunk is None:
                break  # head of line waits for blocks; later ones do not jump ahead
            self.waiting.popleft()
            self.running.append(seq)
            self.running.sort(key=lambda s: (s.arrived_step, s.request.index))  # oldest first
            if seq.first_scheduled_step is None:
                seq.first_scheduled_step = step
            out.append(chunk)
            budget -= chunk.count
        return out

    def adopt(self, seq: Sequence, step: int) -> bool:
        """Run a sequence whose prompt another engine computed (engine.disagg.roles): blocks for its
        prompt, which is then cached, its first token already in `output`. False (and no
        change) when the blocks or max_num_seqs leave no room for it yet."""
        prompt = len(seq.request.prompt_token_ids)
        if not seq.blocks:
            seq.blocks = self.pool.table()
        if len(self.running) >= self.max_num_seqs or not self.pool.grow(seq.blocks, prompt):
            return False
        self.commit(Scheduled(seq, 0, prompt))  # names its full prompt blocks for later prompts
        seq.cached, seq.first_scheduled_step = prompt, step
        self.running.append(seq)
        self.running.sort(key=lambda s: (s.arrived_step, s.request.index))
        return True

    def fork(self, parent: Sequence, child: Sequence, step: int) -> list[tuple[int, int]]:
        """A copy of parent's request (engine.batch.copies), its first token already in its
        output, takes parent's computed prompt and runs: parent's full prompt blocks shared,
        the partly filled last one copied into a block of its own. Returns the (source,
        destination) blocks every rank copies in its caches now. Where that cannot be (no
        room in max_num_seqs or no free block, a sliding window or context parallel stripes
        in the pool) the child waits at the head of the queue instead, and when admitted
        finds the full blocks in the prefix cache: [] either way when nothing is copied."""
        prompt, size = len(parent.request.prompt_token_ids), self.pool.block_size
        full = prompt // size
        child.blocks = self.pool.table()
        plain = type(self.pool) is BlockPool and self.pool.stripes == 1 and self.window is None
        if not plain or parent.cached < prompt or len(self.running) >= self.max_num_seqs \
                or (prompt % size and not self.pool.can_grow([0] * full, prompt)):
            self.waiting.appendleft(child)
            return []
        self.pool.share(child.blocks, parent.blocks[:full])
        copies = []
        if prompt % size:
            self.pool.grow(child.blocks, prompt)
            copies.append((parent.blocks[full], child.blocks[full]))
        child.cached = child.cached_tokens = prompt
        child.named = min(parent.named, full)
        child.names = list(parent.names[:child.named])
        child.first_scheduled_step = step
        self.running.append(child)
        self.running.sort(key=lambda s: (s.arrived_step, s.request.index))
        return copies

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.release(seq.blocks)

    def end(self, seq: Sequence) -> None:
        """A sequence leaves, running (its blocks freed) or still waiting (it holds none)."""
        if seq in self.running:
            self.finish(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            if self.tiers is not None:  # back from loading, its blocks read but not taken yet
                self.tiers.cancel(seq)
        elif seq in self.loading:
            self.loading.remove(seq)
            self.tiers.cancel(seq)
