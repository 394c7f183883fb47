"""MicroBatch: the chunks one tick feeds to the first stage, as the device sees them: their
token ids and attention metadata, made on first use, and the draw of each chunk's next token
(or a verify step's accepted drafts) from the logits."""

from __future__ import annotations

import torch

from atoll.engine.batch.scheduler import Scheduled
from atoll.engine.sample.sampler import logprob_rows, sample
from atoll.engine.sample.verify import verify_greedy, verify_sampled
from atoll.layers.attention import AttentionMetadata


class MicroBatch:
    """The chunks one tick feeds to the first stage. Its token ids and attention metadata go to
    the device on first use, in one copy each: the CUDA-graph decode step (engine.step.graphs)
    packs its own inputs from the chunks and never makes them."""

    def __init__(self, chunks: list[Scheduled], block_size: int, device="cpu"):
        self.chunks, self.block_size, self.device = chunks, block_size, device
        self._ids: torch.Tensor | None = None
        self._meta: AttentionMetadata | None = None
        self.logprobs: torch.Tensor | None = None  # [seqs, 1 + 2k] on the sampling rank, when asked
        self.tier_saves: list = []  # (block, name, parent) it fills, for the KV tiers (engine.rank.kv_tiers)

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
        rows (engine.sample.sampler.logprob_rows)."""
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
        chunk -> [seqs, width] tokens each sequence takes, -1 padded (engine.sample.verify)."""
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
