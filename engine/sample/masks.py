"""The grammar bitmasks of one micro-batch, filled on a thread of the sampling rank while the
model's forward runs, and applied to the logits before a token is drawn.

The runner starts the fill before its stage's forward (GrammarMasks.start); MicroBatch.sample
waits for it only once the logits are there. llguidance computes each mask with the GIL
released, so the forward and the masks run side by side; on a host of 8 cores or more the
rows without drafts are filled by llguidance's own threads (LLExecutor), in parallel.

A chunk with a draft (speculative decoding) gets one mask per position: position j's is the
grammar's state after the draft's first j tokens, which the fill consumes and then rolls back,
so the matcher ends where the sequence's output ends. A drafted token the
grammar refuses is masked at its own position, so verification rejects it there and no later
position's mask is read. Once a grammar is complete its mask allows its end token; every stop
token of the request (LLM.prepare joins EOS to them) is then allowed too."""

from __future__ import annotations

import time

import numpy as np
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
        self._pending = False  # filled at result() on the caller's thread (no pool: no core to spare)

    def start(self, pool) -> "GrammarMasks":
        """Fills the masks on `pool` (a one-thread executor the runner owns), or, with no pool,
        at result() once the logits are there (engine.rank.runner: a CPU forward that uses every
        core has none to spare, and a fill beside it slows it more than the fill takes). The bitmask is
        made here: the thread calls no torch operation, whose own thread pool would then spin
        beside the forward's (on a CPU rank that halves the forward's speed)."""
        total = sum(1 + len(draft) for _, _, draft in self.entries)
        self.bitmask = torch.full((total, self.grammars.words), -1, dtype=torch.int32)  # unread past a refused draft
        at = 0
        for i, _, draft in self.entries:
            self.rows[i] = self.bitmask[at:at + 1 + len(draft)]
            at += 1 + len(draft)
        if pool is not None:
            self._future = pool.submit(self.fill)
        else:
            self._pending = True
        return self

    def result(self) -> dict[int, torch.Tensor]:
        if self._pending:
            self._pending = False
            self.fill()
        if self._future is not None:
            t0 = time.perf_counter()
            self._future.result()  # the fill's exception, if any, is raised here
            self._future = None
            self.grammars.waited_s += time.perf_counter() - t0  # the fill's time the forward did not hide
        return self.rows

    def fill(self) -> None:
        """On the pool's thread: llguidance (which drops the GIL) and numpy only. Each matcher
        catches up with its sequence's output, then fills its rows: the next token's mask and,
        for a draft, the mask after each of the draft tokens the grammar takes (consumed one by
        one, then rolled back)."""
        t0 = time.perf_counter()
        g = self.grammars
        words = self.bitmask.numpy()  # the same memory
        size = words.shape[1] * 4
        plain, at = [], 0
        for i, seq, draft in self.entries:
            state = seq.state.grammar
            state.catch_up(seq.output)
            m = state.matcher
            if not draft and g.parallel:
                plain.append((m, at))
            else:
                m.unsafe_compute_mask_ptr(words[at].ctypes.data, size)
            if draft:
                taken = m.validate_tokens(list(draft))  # the draft's tokens the grammar takes, in order
                for j in range(taken):
                    m.consume_token(draft[j])
                    m.unsafe_compute_mask_ptr(words[at + 1 + j].ctypes.data, size)
                m.rollback(taken)
            at += 1 + len(draft)
        if plain:  # many cores: llguidance's own threads fill the rows side by side
            llg_torch.fill_next_token_bitmask_par(g.executor, plain, self.bitmask)
        if g.eos is not None:
            at = 0
            for i, seq, draft in self.entries:
                _allow_stops(words[at:at + 1 + len(draft)], g.eos, seq.request.params.stop_token_ids, g.vocab_size)
                at += 1 + len(draft)
        g.masks += 1
        g.mask_s += time.perf_counter() - t0


def _bit(token: int) -> tuple[int, int]:
    """(word, int32 value) of a token's bit."""
    b = token % 32
    return token // 32, (1 << b) - (1 << 32 if b == 31 else 0)


def _allow_stops(rows: np.ndarray, eos: int, stops, vocab: int) -> None:
    """rows: [positions, words] int32. In each row that allows the grammar's end token, every
    stop token is allowed too; and in a row that allows nothing (a matcher in error), they
    alone are."""
    w, v = _bit(eos)
    ends = np.flatnonzero(((rows[:, w] & v) != 0) | (rows == 0).all(1)).tolist()
    for r in ends:
        for t in stops:
            if t < vocab:
                tw, tv = _bit(t)
                rows[r, tw] |= tv


def apply_masks(logits: torch.Tensor, rows: list[int], masks: list[torch.Tensor]) -> None:
    """logits: [n, vocab] float, changed in place at `rows`; masks: each a [k, words] int32
    bitmask (on the CPU) of as many of those rows, in order: a token whose bit is off gets
    -inf. One unpacking for all the rows."""
    if not rows:
        return
    mask = torch.cat(masks)  # [len(rows), words] int32, on the CPU
    vocab = logits.shape[1]
    if logits.device.type == "cpu":  # numpy unpacks the bits a byte at a time: ~10x the shifts below
        bits = np.unpackbits(mask.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")
        refused = torch.from_numpy(np.bitwise_xor(bits, 1, out=bits)).view(torch.bool)
    else:
        mask = mask.to(logits.device, non_blocking=True)
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        refused = ((mask.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab] == 0
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(refused, NEG_INF)
        return
    at = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[at] = logits[at].masked_fill(refused, NEG_INF)
