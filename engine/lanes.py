"""Lanes and micro-batches: how pipelined decode keeps every stage busy.

Under PP the requests are split between lanes, each a `Scheduler` with its own share of the
KV blocks. Tick t schedules lane t mod pp and feeds its micro-batch to the first stage,
while stage s works on the micro-batch that entered at tick t - s. With pp lanes a micro-
batch enters every tick, so every stage works every tick; with one lane (`pipelined=False`)
a micro-batch enters every pp-th tick and each stage idles pp - 1 ticks of every pp.
max_num_seqs bounds each micro-batch, as in vLLM: pp lanes keep up to pp x max_num_seqs
sequences running, each stage reading its weights once per tick for max_num_seqs of them.

A lane is scheduled again only after its last micro-batch has left the last stage and its
tokens are known, so a sequence is never scheduled, grown or preempted while in flight.
Every rank of a replica runs the same lanes on the same tokens, so all agree on every
micro-batch without communication.
"""

from __future__ import annotations

import torch

from atoll.engine.blocks import BlockPool
from atoll.engine.sampling import logprob_rows, sample
from atoll.engine.verify import verify_greedy, verify_sampled
from atoll.engine.scheduler import Scheduled, Scheduler, Sequence
from atoll.engine.window_pool import WindowedPool
from atoll.layers.attention import AttentionMetadata


class MicroBatch:
    """The chunks one tick feeds to the first stage. Its token ids and attention metadata go to
    the device on first use, in one copy each: the CUDA-graph decode step (engine.graphs)
    packs its own inputs from the chunks and never makes them."""

    def __init__(self, chunks: list[Scheduled], block_size: int, device="cpu"):
        self.chunks, self.block_size, self.device = chunks, block_size, device
        self._ids: torch.Tensor | None = None
        self._meta: AttentionMetadata | None = None
        self.logprobs: torch.Tensor | None = None  # [seqs, 1 + 2k] on the sampling rank, when asked

    @classmethod
    def of(cls, chunks: list[Scheduled], block_size: int, *, device="cpu") -> "MicroBatch":
        return cls(chunks, block_size, device)

    @property
    def tokens(self) -> int:
        """New tokens of the micro-batch, all chunks together."""
        return sum(c.count for c in self.chunks)

    @property
    def is_decode(self) -> bool:
        return all(c.count == 1 for c in self.chunks)

    @property
    def decode_rows(self) -> bool:
        """Whether every chunk is a decoding sequence's pending token and its drafts (a plain
        decode step, or a verify step): `meta` then holds one decode row per token."""
        return all(c.count == 1 + len(c.draft) for c in self.chunks)

    @property
    def ids(self) -> torch.Tensor:
        """[tokens] every chunk's new tokens, concatenated."""
        if self._ids is None:
            ids = [t for c in self.chunks for t in c.token_ids]
            self._ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        return self._ids

    @property
    def meta(self) -> AttentionMetadata:
        if self._meta is None:
            chunks = self.chunks
            if self.width > 1 and self.decode_rows:
                self._meta = self._verify_rows()
                return self._meta
            self._meta = AttentionMetadata.build([c.seq.blocks for c in chunks], [c.start for c in chunks],
                                                 [c.count for c in chunks], self.block_size, device=self.device)
            if self.width > 1:  # the model's logits rows: every position of a verified chunk, not just its last
                rows, end = [], 0
                for c in chunks:
                    end += c.count
                    rows.extend(range(end - 1 - len(c.draft), end))
                self._meta._memo["last"] = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self._meta

    def _verify_rows(self) -> AttentionMetadata:
        """A verify step of decoding sequences as a decode step of one row per position: the
        pending token and each draft attend as a decoding token would, over the cache up to
        their own position (each layer writes the step's keys before any row reads them), and
        the model gives logits for every row. The decode attention path reads a sequence's
        blocks once per row instead of expanding its context into a causal prefill."""
        tables, starts = [], []
        for c in self.chunks:
            tables += [c.seq.blocks] * c.count
            starts += range(c.start, c.start + c.count)
        return AttentionMetadata.build(tables, starts, [1] * len(starts), self.block_size, device=self.device)

    @property
    def width(self) -> int:
        """Tokens a chunk may take this step: 1, or 1 + the longest draft (speculative verify)."""
        return 1 + max((len(c.draft) for c in self.chunks), default=0)

    @property
    def logprobs_k(self) -> int | None:
        """The most alternatives any chunk asks logprobs of; None: no chunk asks (every rank
        knows, from the same schedule, whether a tick hands logprobs round)."""
        asks = [c.seq.request.params.logprobs for c in self.chunks if c.seq.request.params.logprobs is not None]
        return max(asks) if asks else None

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [seqs, vocab] -> [seqs] tokens; -1 for a prefill chunk short of its last
        prompt token, which draws nothing (a seeded sampler's stream does not depend on how
        the prompt was chunked). When a chunk asks for logprobs, self.logprobs holds their
        rows (engine.sampling.logprob_rows)."""
        if self.width > 1:
            return self._verify(logits)
        rows = [i for i, c in enumerate(self.chunks) if c.samples]
        if len(rows) == len(self.chunks):  # every chunk samples (all of a decode step): no scatter
            out = sample(logits, [c.seq.state for c in self.chunks])
        else:
            out = torch.full((len(self.chunks),), -1, dtype=torch.long, device=logits.device)
            if rows:
                at = torch.tensor(rows, dtype=torch.long, device=logits.device)
                out[at] = sample(logits[at], [self.chunks[i].seq.state for i in rows])
        k = self.logprobs_k
        if k is not None:
            self.logprobs = logprob_rows(logits, out, k)
        return out


    def _verify(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [rows, vocab], a verified chunk's 1 + len(draft) rows, one for any other
        chunk -> [seqs, width] tokens each sequence takes, -1 padded (engine.verify)."""
        width, n = self.width, len(self.chunks)
        at = torch.tensor([[min(j, len(c.draft)) for j in range(width)] for c in self.chunks], dtype=torch.long,
                          device=logits.device)
        at += torch.tensor([0] + [1 + len(c.draft) for c in self.chunks[:-1]], device=logits.device).cumsum(0)[:, None]
        grid = logits[at.view(-1)].view(n, width, -1)  # [seqs, width, vocab]; short drafts repeat their last row
        drafts = torch.tensor([c.draft + [-1] * (width - 1 - len(c.draft)) for c in self.chunks], dtype=torch.long,
                              device=logits.device)
        out = verify_greedy(grid, drafts)
        for i, c in enumerate(self.chunks):
            if not c.samples:
                out[i] = -1  # a prefill chunk short of its last prompt token
            elif not c.seq.request.params.greedy:
                out[i] = -1
                out[i, :1 + len(c.draft)] = verify_sampled(grid[i, :1 + len(c.draft)], c.draft, c.seq.state)
        k = self.logprobs_k
        if k is not None:  # a chunk that asks for logprobs drafts nothing: its one row is row 0
            self.logprobs = logprob_rows(grid[:, 0], out[:, 0], k)
        return out


def lane_count(*, num_blocks: int, block_size: int, max_model_len: int, depth: int, pipelined: bool = True,
               cp: int = 1) -> int:
    """depth lanes when pipelined, but no more than the blocks allow while each lane still
    holds one max_model_len sequence (num_blocks per rank, a sequence striped over cp ranks);
    at least one."""
    per_seq = -(-(-(-max_model_len // block_size)) // cp)
    return max(1, min(depth if pipelined else 1, num_blocks // per_seq))


class Lanes:
    def __init__(self, *, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, depth: int, pipelined: bool = True, prefix_caching: bool = False,
                 drafter=None, sliding_window: int | None = None, cp: int = 1,
                 window_pool: tuple[int, int] | None = None):
        """depth: pipeline stages; as many lanes as `lane_count` gives. prefix_caching: each
        lane's pool keeps its own cache of named blocks (engine.blocks). drafter: speculative
        tokens for every lane (engine.drafters), or None. sliding_window: blocks a running
        sequence's window has passed go back to its lane's pool (block num_blocks, the cache's
        scratch block, stands in for them). cp: context parallel ranks; num_blocks is per rank
        and each pool stripes a sequence's blocks over the cp ranks (engine.blocks).
        window_pool: (width, blocks) when the sliding layers keep their own cache of `blocks`
        blocks (engine.window_pool; width their widest window); its block `blocks` is its hole."""
        count = lane_count(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
                           depth=depth, pipelined=pipelined, cp=cp)
        share = num_blocks // count
        self.depth = depth
        # the hole's global id reads as local block num_blocks (the scratch block) on every cp rank
        pools = [BlockPool(share, block_size, first=i * share, hole=num_blocks * cp, stripes=cp) for i in range(count)]
        if window_pool is not None:
            if cp != 1:
                raise ValueError("a sliding layers' pool is not striped over cp ranks")
            sliding_window, blocks = window_pool
            part = blocks // count
            pools = [WindowedPool(pool, BlockPool(part, block_size, first=i * part, hole=blocks), sliding_window)
                     for i, pool in enumerate(pools)]
        self.schedulers = [Scheduler(pool, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                     prefix_caching=prefix_caching, drafter=drafter, sliding_window=sliding_window)
                           for pool in pools]

    def __len__(self) -> int:
        return len(self.schedulers)

    def add(self, seq: Sequence) -> None:
        """To the lane with the fewest unfinished sequences (the first of those on a tie)."""
        loads = [len(s.waiting) + len(s.running) for s in self.schedulers]
        seq.lane = loads.index(min(loads))
        self.schedulers[seq.lane].add(seq)

    def adopt(self, seq: Sequence, step: int) -> bool:
        """A sequence whose prompt is already computed elsewhere, to the least loaded lane
        (Scheduler.adopt); False when that lane has no room yet."""
        loads = [len(s.waiting) + len(s.running) for s in self.schedulers]
        seq.lane = loads.index(min(loads))
        return self.schedulers[seq.lane].adopt(seq, step)

    def at(self, tick: int) -> Scheduler | None:
        """The lane whose micro-batch enters the pipeline at this tick, if any."""
        slot = tick % self.depth
        return self.schedulers[slot] if slot < len(self.schedulers) else None

    def has_work(self) -> bool:
        return any(s.has_work() for s in self.schedulers)

    def finish(self, seq: Sequence) -> None:
        self.schedulers[seq.lane].finish(seq)

    def end(self, seq: Sequence) -> None:
        """The sequence leaves its lane, waiting or running (Scheduler.end)."""
        self.schedulers[seq.lane].end(seq)
