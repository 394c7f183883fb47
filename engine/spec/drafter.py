"""Drafter: what every speculative drafter shares (engine.spec.registry names them by method): which decoding chunks get a draft, how
long it may be, and the blocks it takes."""

from __future__ import annotations

from abc import ABC, abstractmethod

from atoll.config.speculative import SpeculativeConfig
from atoll.errors import InputError


class Drafter(ABC):
    """What every drafter shares: which chunks get a draft, and how long it may be. A subclass
    names its `method` (engine.spec.registry) and may check its config before any rank starts."""

    method: str

    def __init__(self, cfg: SpeculativeConfig, *, max_model_len: int, runner=None):
        self.cfg, self.max_model_len = cfg, max_model_len

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
            k = min(cfg.k, budget, self.max_model_len - seq.length - 1, params.max_tokens - len(seq.output) - 1)
            if k < 1 or not pool.grow(seq.blocks, c.start + 1 + k):
                continue
            budget -= k
            wants.append((c, k))
        if not wants:
            return 0
        used = 0
        for (c, k), draft in zip(wants, self.propose([(c.seq, k) for c, k in wants])):
            c.draft = list(draft[:k])
            c.count += len(c.draft)
            used += len(c.draft)
            pool.trim(c.seq.blocks, c.start + c.count)  # the blocks a shorter draft left unused
        return used

    @abstractmethod
    def propose(self, wants: list[tuple]) -> list[list[int]]:
        """[(sequence, k)] -> each sequence's draft, at most k tokens (maybe none)."""
