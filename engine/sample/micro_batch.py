"""MicroBatch: the chunks one tick feeds to the first stage, as the device sees them: their
token ids and attention metadata, made on first use, and the draw of each chunk's next token
(or a verify step's accepted drafts) from the logits, after the requests' logits processors
(engine.sample.processors).

Rows of the model's logits: one per chunk (its last position), 1 + its draft for a verified
chunk, and every position of a prompt chunk whose request asks for prompt_logprobs. A chunk
whose sequence leads parked copies (engine.batch.copies: n > 1) draws one token for itself
and one for each copy from its last row, each with its own generator, so the prompt is
computed once. A request with structured outputs draws from its logits with its grammar's
mask applied (engine.sample.masks: filled beside the forward, `start_masks`)."""

from __future__ import annotations

from functools import cached_property

import torch

from atoll.engine.batch.scheduler import Scheduled
from atoll.engine.sample.masks import GrammarMasks, apply_masks
from atoll.engine.sample.processors import process_row, processed
from atoll.engine.sample.sampler import logprob_rows, probabilities, prompt_logprob_rows, sample, sample_one
from atoll.engine.sample.tree_rule import walk_greedy, walk_sampled
from atoll.engine.sample.verify import verify_greedy, verify_sampled
from atoll.engine.sample.tree import depths, verify_meta
from atoll.layers.attention import AttentionMetadata


def draws(c: Scheduled) -> int:
    """Tokens drawn from the chunk's last row: 1, or with parked copies 1 + their number."""
    return 1 + len(c.seq.followers) if c.samples and c.seq.followers else 1


def prompt_positions(c: Scheduled) -> range:
    """The chunk's positions whose logits give a prompt token's logprobs (the next token is a
    prompt token), when its request asks for them; else none."""
    if c.seq.request.params.prompt_logprobs is None:
        return range(0)
    prompt = len(c.seq.request.prompt_token_ids)
    return range(c.start, min(c.start + c.count, prompt - 1))


class MicroBatch:
    """The chunks one tick feeds to the first stage. Its token ids and attention metadata go to
    the device on first use, in one copy each: the CUDA-graph decode step (engine.step.graphs)
    packs its own inputs from the chunks and never makes them."""

    def __init__(self, chunks: list[Scheduled], block_size: int, device="cpu"):
        self.chunks, self.block_size, self.device = chunks, block_size, device
        self._ids: torch.Tensor | None = None
        self._meta: AttentionMetadata | None = None
        self.logprobs: torch.Tensor | None = None  # [seqs, draws + 2k] on the sampling rank, when asked
        self.prompt_logprobs: torch.Tensor | None = None  # [prompt rows, 2 + 2k], when asked
        self.tier_saves: list = []  # (block, name, parent) it fills, for the KV tiers (engine.rank.kv_tiers)
        self.out_width: int | None = None  # width of the tokens handed round, once agreed (engine.rank.runner)
        # rows every DP replica's decode step runs at, once agreed (MoE with DP: engine.rank.runner);
        # 0: every replica eager this step; None: not agreed (the replica decides alone)
        self.step_rows: int | None = None
        self.draws = max((draws(c) for c in chunks), default=1)
        self.masks: GrammarMasks | None = None  # the grammars' masks, once started (sampling rank)

    def start_masks(self, grammars, pool) -> None:
        """Starts filling the masks of the chunks whose requests have structured outputs (on
        the sampling rank, before the forward: engine.rank.runner); pool() gives the thread."""
        entries = [(i, c.seq, c.draft) for i, c in enumerate(self.chunks)
                   if c.samples and c.seq.request.params.structured_outputs is not None]
        if entries:
            self.masks = GrammarMasks(entries, grammars).start(pool())

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
    def tree(self) -> bool:
        """Whether a chunk carries a tree draft (engine.sample.tree): its rows read a tree mask,
        which the compiled and captured decode steps do not build."""
        return any(c.parents is not None for c in self.chunks)

    def logit_rows(self, c: Scheduled) -> int:
        """Rows of the model's logits for chunk c: its last 1 + len(draft) positions, or every
        position of a prompt chunk that asks for prompt logprobs."""
        return c.count if prompt_positions(c) else 1 + len(c.draft)

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
            if any(n > 1 for n in self.rows):  # the model's logits rows: more than the last
                rows, end = [], 0
                for c, n in zip(chunks, self.rows):
                    end += c.count
                    rows.extend(range(end - n, end))
                self._meta._memo["last"] = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self._meta

    def _verify_rows(self) -> AttentionMetadata:
        """A verify step of decoding sequences as a decode step of one row per position: the
        pending token and each draft attend as a decoding token would, over the cache up to
        their own position (each layer writes the step's keys before any row reads them), and
        the model gives logits for every row. The decode attention path reads a sequence's
        blocks once per row instead of expanding its context into a causal prefill. With a tree
        draft, each row reads its context and its ancestors only (engine.sample.tree)."""
        if self.tree:
            return verify_meta(self.chunks, self.block_size, device=self.device)
        tables, starts = [], []
        for c in self.chunks:
            tables += [c.seq.blocks] * c.count
            starts += range(c.start, c.start + c.count)
        return AttentionMetadata.build(tables, starts, [1] * len(starts), self.block_size, device=self.device)

    @property
    def width(self) -> int:
        """Tokens a chunk may take this step: 1, or 1 + the longest draft (speculative verify)."""
        return 1 + max((len(c.draft) for c in self.chunks), default=0)

    @cached_property
    def rows(self) -> list[int]:
        """Each chunk's rows of the model's logits (logit_rows), computed once."""
        return [self.logit_rows(c) for c in self.chunks]

    @cached_property
    def logprobs_k(self) -> int | None:
        """The most alternatives any chunk asks logprobs of; None: no chunk asks (every rank
        knows, from the same schedule, whether a tick hands logprobs round)."""
        asks = [c.seq.request.params.logprobs for c in self.chunks if c.seq.request.params.logprobs is not None]
        return max(asks) if asks else None

    @cached_property
    def prompt_logprobs_k(self) -> int | None:
        """The most alternatives any chunk with prompt-logprob rows asks for; None: none has them."""
        asks = [c.seq.request.params.prompt_logprobs for c in self.chunks if prompt_positions(c)]
        return max(asks) if asks else None

    @property
    def prompt_rows(self) -> int:
        return sum(len(prompt_positions(c)) for c in self.chunks)

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [rows, vocab] -> [seqs] tokens, or [seqs, w] when a chunk draws for its
        copies or drafts were verified; -1 for a prefill chunk short of its last prompt token,
        which draws nothing (a seeded sampler's stream does not depend on how the prompt was
        chunked). self.logprobs and self.prompt_logprobs hold the rows asked for."""
        if any(n != 1 + len(c.draft) for n, c in zip(self.rows, self.chunks)):
            logits = self._take_prompt_rows(logits, self.rows)
        if self.width > 1:
            return self._verify(logits)
        n, w = len(self.chunks), self.draws
        at = [i for i, c in enumerate(self.chunks) if c.samples]
        if len(at) == n and w == 1 and self.masks is None \
                and not any(c.seq.request.params.processed for c in self.chunks):
            out = sample(logits, [c.seq.state for c in self.chunks],  # every chunk samples (all of a decode step)
                         [len(c.seq.output) for c in self.chunks])
        else:
            out = torch.full((n, w), -1, dtype=torch.long, device=logits.device)
            if at:
                index = torch.tensor(at, dtype=torch.long, device=logits.device)
                chosen = self._processed(logits[index], at)
                out[index, 0] = sample(chosen, [self.chunks[i].seq.state for i in at],
                                       [len(self.chunks[i].seq.output) for i in at])
                for r, i in enumerate(at):
                    for j, copy in enumerate(self.chunks[i].seq.followers):
                        out[i, 1 + j] = sample_one(chosen[r], copy.state, 0)
            out = out[:, 0] if w == 1 else out
        k = self.logprobs_k
        if k is not None:
            self.logprobs = logprob_rows(logits, out, k)
        return out

    def _processed(self, logits: torch.Tensor, at: list[int]) -> torch.Tensor:
        """One sampling row per chunk of `at` (chunk indices), with its request's processors
        and grammar mask applied (a copy)."""
        chunks = [self.chunks[i] for i in at]
        if not any(c.seq.request.params.processed for c in chunks) and self.masks is None:
            return logits
        out = processed(logits, [(c.seq.state.processors, c.seq.output, ()) for c in chunks])
        if self.masks is not None:
            rows = self.masks.result()
            masked = [(r, rows[i][:1]) for r, i in enumerate(at) if i in rows]
            apply_masks(out, [r for r, _ in masked], [m for _, m in masked])
        return out

    def _take_prompt_rows(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Computes the prompt-logprob rows (self.prompt_logprobs) from the raw logits, and
        returns the rows the chunks sample from (the last 1 + len(draft) of each)."""
        keep, lp_rows, targets, end = [], [], [], 0
        for c, n in zip(self.chunks, rows):
            keep.extend(range(end + n - 1 - len(c.draft), end + n))
            positions = prompt_positions(c)
            if positions:  # a prompt chunk's rows are its positions, from c.start
                lp_rows.extend(end + q - c.start for q in positions)
                targets.extend(c.seq.request.prompt_token_ids[q + 1] for q in positions)
            end += n
        if lp_rows:
            at = torch.tensor(lp_rows, dtype=torch.long, device=logits.device)
            self.prompt_logprobs = prompt_logprob_rows(
                logits[at], torch.tensor(targets, dtype=torch.long, device=logits.device), self.prompt_logprobs_k)
        return logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]

    def _verify(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [rows, vocab], a verified chunk's 1 + len(draft) rows, one for any other
        chunk -> [seqs, width] tokens each sequence takes, -1 padded (engine.sample.verify).
        A drafted row is processed as if the drafts before it had been generated."""
        width, n = self.width, len(self.chunks)
        at = torch.tensor([[min(j, len(c.draft)) for j in range(width)] for c in self.chunks], dtype=torch.long,
                          device=logits.device)
        at += torch.tensor([0] + [1 + len(c.draft) for c in self.chunks[:-1]], device=logits.device).cumsum(0)[:, None]
        raw = logits[at.view(-1)].view(n, width, -1)  # [seqs, width, vocab]; short drafts repeat their last row
        grid = raw
        if any(c.seq.request.params.processed for c in self.chunks) or self.masks is not None:
            grid = raw.float().clone()
            for i, c in enumerate(self.chunks):
                if c.samples and c.seq.request.params.processed:
                    for j in range(1 + len(c.draft)):
                        process_row(grid[i, j], c.seq.state.processors, c.seq.output, c.draft[:j])
            rows = self.masks.result() if self.masks is not None else {}
            # position j: the grammar after the draft's first j tokens
            flat = [i * width + j for i, mask in rows.items() for j in range(len(mask))]
            apply_masks(grid.view(n * width, -1), flat, list(rows.values()))
        drafts = torch.tensor([c.draft + [-1] * (width - 1 - len(c.draft)) for c in self.chunks], dtype=torch.long,
                              device=logits.device)
        out = verify_greedy(grid, drafts)
        if self.draws > width:
            out = torch.cat([out, torch.full((n, self.draws - width), -1, dtype=torch.long, device=out.device)], 1)
        for i, c in enumerate(self.chunks):
            if not c.samples:
                out[i] = -1  # a prefill chunk short of its last prompt token
                continue
            if c.parents is not None:
                out[i] = -1
                taken = self._walk(c, grid[i, :1 + len(c.draft)])
                out[i, :len(taken)] = torch.tensor(taken, dtype=torch.long, device=out.device)
            elif not c.seq.request.params.greedy:
                out[i] = -1
                out[i, :1 + len(c.draft)] = verify_sampled(grid[i, :1 + len(c.draft)], c.draft, c.seq.state,
                                                           len(c.seq.output))
            for j, copy in enumerate(c.seq.followers):  # a prompt's chunk: no draft, its row 0
                out[i, 1 + j] = sample_one(grid[i, 0], copy.state, 0)
        if self.tree:  # a tree takes at most its depth + 1 tokens: the width a tick hands round
            out = out[:, :max(self.draws, *(1 + (max(depths(c.parents)) if c.parents else len(c.draft))
                                             for c in self.chunks))].contiguous()  # broadcast whole
        k = self.logprobs_k
        if k is not None:  # a chunk that asks for logprobs drafts nothing: its one row is row 0
            self.logprobs = logprob_rows(raw[:, 0], out[:, :self.draws], k)
        return out

    @staticmethod
    def _walk(c: Scheduled, logits: torch.Tensor) -> list[int]:
        """A tree chunk's tokens taken: the kept path's drafts, then the target's own token
        (engine.sample.tree_rule) from logits [nodes, vocab]; one host read of its rows."""
        tokens, state = [c.seq.tokens[-1], *c.draft], c.seq.state
        if state.params.greedy:
            path, nxt = walk_greedy(c.parents, tokens, logits.argmax(-1).tolist())
        else:
            p = torch.stack([probabilities(row, state.params) for row in logits])
            base = len(c.seq.output)  # the node at depth d decides output token base + d
            path, nxt = walk_sampled(c.parents, tokens, p, gen_at=lambda d: state.at(base + d))
        return [tokens[n] for n in path] + [nxt]
