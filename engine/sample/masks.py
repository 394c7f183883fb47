"""The grammar bitmasks of one micro-batch, filled on a thread of the sampling rank while the
model's forward runs, and applied to the logits before a token is drawn.

The runner starts the fill before its stage's forward (GrammarMasks.start); MicroBatch.sample
waits for it only once the logits are there. llguidance computes the masks with the GIL
released, on its own threads (LLExecutor), so the forward and the masks run side by side.

A chunk with a draft (speculative decoding) gets one mask per position: position j's is the
grammar's state after the draft's first j tokens, which llguidance's draft fill consumes and
then rolls back, so the matcher ends where the sequence's output ends. A drafted token the
grammar refuses is masked at its own position, so verification rejects it there and no later
position's mask is read. Once a grammar is complete its mask allows its end token; every stop
token of the request (LLM.prepare joins EOS to them) is then allowed too."""

from __future__ import annotations

import torch
import llguidance.torch as llg_torch

NEG_INF = float("-inf")


class GrammarMasks:
    """entries: (chunk index, sequence, draft) for each sampling chunk whose request has
    structured outputs. After result(): rows[i] = the bitmask rows of chunk i, [1 + len(draft),
    words] int32 on the CPU."""

    def __init__(self, entries: list[tuple], grammars):
        self.entries, self.grammars = entries, grammars
        self.rows: dict[int, torch.Tensor] = {}
        self._future = None

    def start(self, pool) -> "GrammarMasks":
        """Fills the masks on `pool` (a one-thread executor the runner owns)."""
        self._future = pool.submit(self.fill)
        return self

    def result(self) -> dict[int, torch.Tensor]:
        if self._future is not None:
            self._future.result()  # the fill's exception, if any, is raised here
            self._future = None
        return self.rows

    def fill(self) -> None:
        g = self.grammars
        total = sum(1 + len(draft) for _, _, draft in self.entries)
        bitmask = torch.full((total, g.words), -1, dtype=torch.int32)  # rows past a refused draft: unread
        jobs, at = [], 0
        for i, seq, draft in self.entries:
            state = seq.state.grammar
            state.catch_up(seq.output)
            jobs.append((state.matcher, at, list(draft)))
            self.rows[i] = bitmask[at:at + 1 + len(draft)]
            at += 1 + len(draft)
        plain = [(m, row) for m, row, draft in jobs if not draft]
        if plain:
            llg_torch.fill_next_token_bitmask_par(g.executor, plain, bitmask)
        drafted = [job for job in jobs if job[2]]
        if drafted:
            llg_torch.fill_next_token_bitmask_par_with_draft_tokens(g.executor, drafted, bitmask)
        if g.eos is not None:
            for i, seq, _ in self.entries:
                _allow_stops(self.rows[i], g.eos, seq.request.params.stop_token_ids, g.vocab_size)


def _bit(token: int) -> tuple[int, int]:
    """(word, int32 value) of a token's bit."""
    b = token % 32
    return token // 32, (1 << b) - (1 << 32 if b == 31 else 0)


def _allow_stops(rows: torch.Tensor, eos: int, stops, vocab: int) -> None:
    """In each row that allows the grammar's end token, every stop token is allowed too; and
    in a row that allows nothing (a matcher in error), they alone are."""
    w, v = _bit(eos)
    ends = (((rows[:, w] & v) != 0) | (rows == 0).all(1)).nonzero().flatten().tolist()  # host tensor
    for r in ends:
        for t in stops:
            if t < vocab:
                tw, tv = _bit(t)
                rows[r, tw] |= tv


def apply_mask(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """logits: [n, vocab] float, changed in place; mask: [n, words] int32 bitmask (on the CPU):
    each token whose bit is off gets -inf."""
    n, vocab = logits.shape
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((mask.to(logits.device, non_blocking=True).unsqueeze(-1) >> bits) & 1).view(n, -1)[:, :vocab]
    logits.masked_fill_(allowed == 0, NEG_INF)
