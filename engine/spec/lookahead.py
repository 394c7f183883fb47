"""The lookahead drafter: `{"method": "lookahead", "window": W, "ngram": N, "guess": G}`, after
Fu et al., "Break the Sequential Dependency of LLM Inference Using Lookahead Decoding" (2024),
built on the engine's chain verify step. No model.

Each sequence keeps a Jacobi window (a guess for each of its next W positions) and a pool of
n-grams: for each first token, at most G continuations of N - 1 tokens, the latest kept. A
step drafts W tokens: the pool's continuation of the sequence's last token (when it has one)
for the first N - 1 positions, the window's guesses after it. The verify forward scores them
all; past the first rejected draft, the target's argmax at each position (engine.sample.verify
hands it back as -2 - t) is one Jacobi iteration of the window: each position's new guess
given the guesses before it. That becomes the next window, and the diagonal of the last N - 1
iterations (a guess, the next position's guess one iteration later, and so on) gives the pool
its n-grams, as the paper's lookahead branch does. The sequence's own tokens (prompt and
output) feed the pool too, so the pool holds what n-gram prompt lookup would find.

What differs from the paper: its lookahead branch (W x (N - 1) Jacobi tokens) and its G
verification candidates run side by side in one forward under a special attention mask; here
the draft is one chain, so a step verifies one candidate (the latest), and the Jacobi
iteration runs on the chain's guesses past it. Every rank keeps the same pools from the same
tokens, so nothing is sent between ranks.
"""

from __future__ import annotations

from collections import deque

from atoll.engine.spec.drafter import Drafter


class Lookahead:
    """One sequence's window (position -> guess), its last inputs by iteration, and its pool."""

    def __init__(self, ngram: int, guess: int):
        self.n, self.g = ngram, guess
        self.window: dict[int, int] = {}
        self.levels: deque[dict[int, int]] = deque(maxlen=max(ngram - 2, 1))  # newest last
        self.pool: dict[int, list[tuple]] = {}
        self.seen = 0  # the sequence's tokens already read into the pool

    def add(self, gram: tuple) -> None:
        """One n-gram into the pool: kept as its first token's latest, at most G per first token."""
        kept = self.pool.setdefault(gram[0], [])
        rest = gram[1:]
        if rest in kept:
            kept.remove(rest)
        kept.append(rest)
        if len(kept) > self.g:
            del kept[0]

    def read(self, tokens: list[int]) -> None:
        """The n-grams of the sequence's own tokens not read yet."""
        n = self.n
        for end in range(max(self.seen + 1, n), len(tokens) + 1):
            self.add(tuple(tokens[end - n:end]))
        self.seen = max(self.seen, len(tokens))

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens for positions len(tokens).. : the pool's continuation of the last
        token, then the window's guesses, then the sequence's own tokens from where its last
        token occurred before (a first window)."""
        self.read(tokens)
        at = len(tokens)
        kept = self.pool.get(tokens[-1])
        out = list(kept[-1][:k]) if kept else []
        while len(out) < k and at + len(out) in self.window:
            out.append(self.window[at + len(out)])
        if len(out) < k:
            out += fill(tokens, out, k - len(out))
        return out

    def observe(self, at: int, draft: list[int], row: list[int]) -> None:
        """A verify step's outcome: draft[j] stood at position at + j, and row[j] is what the
        target gave for that position (taken if >= 0, else -2 - its argmax, engine.sample.verify)."""
        outputs = {at + j: (t if t >= 0 else -2 - t) for j, t in enumerate(row[:len(draft) + 1]) if t != -1}
        inputs = {at + j: d for j, d in enumerate(draft)}
        self.window = {p: t for p, t in outputs.items() if row[p - at] < -1}
        for p, t in outputs.items():
            if row[p - at] >= 0:
                continue  # a taken token's n-gram comes from read()
            gram = [t]
            for level in [inputs, *reversed(self.levels)][:self.n - 1]:
                if p - len(gram) not in level:
                    break
                gram.append(level[p - len(gram)])
            if len(gram) == self.n:
                self.add(tuple(reversed(gram)))
        self.levels.append(inputs)


def fill(tokens: list[int], have: list[int], k: int) -> list[int]:
    """k guesses to close a draft: what followed the last earlier occurrence of its last token
    (in the sequence and the draft so far), else the sequence's last tokens."""
    seq = tokens + have
    last = seq[-1]
    for i in range(len(seq) - 2, -1, -1):
        if seq[i] == last:
            out = seq[i + 1:i + 1 + k]
            return (out * k)[:k] if out else []
    return (tokens[-k:] * k)[:k]


class LookaheadDrafter(Drafter):
    method = "lookahead"

    def __init__(self, cfg, *, max_model_len: int, runner=None):
        super().__init__(cfg, max_model_len=max_model_len, runner=runner)
        self.states: dict[int, Lookahead] = {}

    def _state(self, seq) -> Lookahead:
        state = self.states.get(seq.request.index)
        if state is None:
            state = self.states[seq.request.index] = Lookahead(self.cfg.ngram, self.cfg.guess)
        return state

    def propose(self, wants):
        return [self._state(seq).draft(seq.tokens, k) for seq, k in wants]

    def observe(self, seq, draft, row) -> None:
        super().observe(seq, draft, row)
        self._state(seq).observe(seq.length, draft, row)

    def forget(self, seq) -> None:
        super().forget(seq)
        self.states.pop(seq.request.index, None)
