"""Drafter: what every speculative drafter shares (engine.spec.registry names them by method): which decoding chunks get a draft, how
long it may be, and the blocks it takes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque

from atoll.config.speculative import SpeculativeConfig
from atoll.errors import InputError


class Drafter(ABC):
    """What every drafter shares: which chunks get a draft, and how long it may be. A subclass
    names its `method` (engine.spec.registry) and may check its config before any rank starts."""

    method: str

    def __init__(self, cfg: SpeculativeConfig, *, max_model_len: int, runner=None):
        self.cfg, self.max_model_len = cfg, max_model_len
        # min_acceptance_rate: each sequence's last verify steps (drafted, accepted), and the
        # decode steps it still sits out, by request index (every rank keeps the same)
        self.recent: dict[int, deque] = {}
        self.paused: dict[int, int] = {}

    @classmethod
    def check(cls, cfg: SpeculativeConfig, layout, config, model_dir) -> None:
        """A one-line InputError when the config cannot run here; by default a drafter with a
        model runs on one pipeline stage and one DP replica."""
        if layout.pp > 1 or layout.dp > 1:
            raise InputError(f"speculative method {cfg.method} runs on one pipeline stage and one DP replica; "
                             f"the layout is {layout}")

    def extend(self, chunks, pool, budget: int, *, running: int) -> int:
        """Adds a draft to each decoding chunk that takes one; returns the tokens added (the
        step's token budget pays for them). A draft never runs past max_tokens or
        max_model_len, and a chunk whose draft finds no free block goes without one."""
        cfg = self.cfg
        if cfg.disable_by_batch_size is not None and running >= cfg.disable_by_batch_size:
            return 0
        wants = []
        for c in chunks:
            seq, params = c.seq, c.seq.request.params
            if c.count != 1 or not c.samples or not seq.output or params.logprobs is not None:
                continue  # a prompt's chunk, or a request that asks for logprobs (given per plain step)
            if self._sits_out(seq.request.index):
                continue
            k = min(cfg.k, budget, self.max_model_len - seq.length - 1, params.max_tokens - len(seq.output) - 1)
            nodes = k
            if self.tree and k >= 1 and not params.processed and params.structured_outputs is None:
                nodes = min(cfg.topk * k, budget, self.max_model_len - seq.length - 1)  # a tree's drafted nodes
            if k < 1 or not pool.grow(seq.blocks, c.start + 1 + nodes):
                continue
            budget -= nodes
            wants.append((c, k, nodes))
        if not wants:
            return 0
        used = 0
        trees = [w for w in wants if w[2] > w[1]]
        chains = [w for w in wants if w[2] == w[1]]
        proposed = self.propose_tree([(c.seq, k, n) for c, k, n in trees]) if trees else []
        proposed += [(d, None) for d in self.propose([(c.seq, k) for c, k, _ in chains])] if chains else []
        for (c, k, n), (draft, parents) in zip(trees + chains, proposed):
            c.draft = list(draft[:n])
            c.parents = None if parents is None or not c.draft else list(parents[:1 + len(c.draft)])
            c.count += len(c.draft)
            used += len(c.draft)
            pool.trim(c.seq.blocks, c.start + c.count)  # the blocks a shorter draft left unused
        return used

    @property
    def tree(self) -> bool:
        """Whether this drafter proposes trees (topk > 1; engine.sample.tree)."""
        return self.cfg.topk > 1

    def propose_tree(self, wants: list[tuple]) -> list[tuple[list[int], list[int]]]:
        """[(sequence, depth, nodes)] -> each sequence's tree: (drafted tokens, the parent of each
        of [pending token] + tokens, -1 first), at most `nodes` drafted, parents before children."""
        raise NotImplementedError(f"speculative method {self.method} drafts no trees")

    def _sits_out(self, index: int) -> bool:
        """Whether the sequence drafts nothing this step (below min_acceptance_rate lately); a
        step sat out counts down its pause."""
        left = self.paused.get(index, 0)
        if left:
            self.paused[index] = left - 1
        return left > 0

    def observe(self, seq, draft: list[int], row: list[int]) -> None:
        """After a verify step, before the sequence takes its tokens: its draft and the row the
        verify gave (the tokens taken, then -2 - the target's argmax at each position past them
        on a greedy row, else -1; engine.sample.verify). Counts the acceptance for
        min_acceptance_rate; a drafter that learns from the target's outputs extends this."""
        floor = self.cfg.min_acceptance_rate
        if floor is None:
            return
        accepted = sum(1 for t in row if t >= 0) - 1
        recent = self.recent.setdefault(seq.request.index, deque(maxlen=self.cfg.acceptance_window))
        recent.append((len(draft), accepted))
        if len(recent) == recent.maxlen:
            drafted = sum(d for d, _ in recent)
            if sum(a for _, a in recent) < floor * drafted:
                self.paused[seq.request.index] = self.cfg.pause_steps
                recent.clear()  # it tries again afresh after the pause

    def forget(self, seq) -> None:
        """The sequence has ended: its state goes."""
        self.recent.pop(seq.request.index, None)
        self.paused.pop(seq.request.index, None)

    @abstractmethod
    def propose(self, wants: list[tuple]) -> list[list[int]]:
        """[(sequence, k)] -> each sequence's draft, at most k tokens (maybe none)."""


def kept_positions(chunks, block_size: int):
    """What a drafter fed by the target's hidden states catches up on after a step: the rows of
    the step's positions the target kept (no rejected draft or tree node) and whose next token is known, and
    for each sequence with any, the sequence, its chunk's start and the count kept. Returns
    (rows, next token ids, sequences, starts, counts); a sequence that ended has let go of its
    blocks and is left out."""
    rows, ids, seqs, starts, counts = [], [], [], [], []
    offset = 0
    for c in chunks:
        seq = c.seq
        keep = min(c.count, seq.cached - c.start)
        tokens = seq.tokens
        if keep > 0 and len(tokens) > c.start + keep and len(seq.blocks) * block_size >= c.start + keep:
            # a tree's kept rows: the pending token's, then the path's nodes (engine.sample.tree)
            rows.extend(offset + n for n in ([0, *(c.path or [])] if c.parents is not None else range(keep))[:keep])
            ids.extend(tokens[c.start + 1:c.start + keep + 1])
            seqs.append(seq)
            starts.append(c.start)
            counts.append(keep)
        offset += c.count
    return rows, ids, seqs, starts, counts
