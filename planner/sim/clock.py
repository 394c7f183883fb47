"""The simulator's clock: the seconds of one engine tick, from the cost model, for the tick's real
micro-batch (planner/cost.py: CostModel.micro_batch).

A micro-batch is its decode rows, the prompt-chunk tokens beside them, and the positions each
attends to: a decoding sequence over its whole context, a chunk's token over the positions
before it in its prompt. The cost model is asked once per distinct step; steps are told
apart by their rows and DP shares exactly, and by their chunk tokens and mean contexts on a
2% grid above 64 (a step's time is smooth in them), so a run of thousands of ticks costs a
few hundred distinct steps.
"""

from __future__ import annotations

import math
from collections import Counter

EXACT = 64  # counts up to this are kept exactly
GRID = 0.02  # above it, a geometric grid this fine
_LOG = math.log1p(GRID)
MEASURED = "measured engine steps (calibrate --steps)"


def bucket(x: float) -> int:
    """x exactly up to EXACT, else the nearest point of a 2% geometric grid above it."""
    if x <= EXACT:
        return round(x)
    return round(EXACT * math.exp(round(math.log(x / EXACT) / _LOG) * _LOG))


class StepCost:
    """One engine's ticks, costed by its layout's CostModel: `tick(...)` gives a micro-batch's
    (pass seconds, slowest stage seconds); `breakdown()` the seconds of every tick counted so
    far by what they were spent on (the cost model's categories)."""

    def __init__(self, cost_model, fit=None):
        """fit: the model's measured ticks on this machine (stepfit.StepFit), which replace the
        cost model where given: a tick of the micro-batch (under PP, its stage; the pass pp ticks)."""
        self.cm, self.fit = cost_model, fit
        self.memo: dict[tuple, tuple[float, float, dict]] = {}
        self.counts: Counter = Counter()  # ticks by step key, for the breakdown

    def tick(self, rows: int, chunk_tokens: int, ctx_sum: float, attended_sum: float, *,
             dp_rows: int | None = None, dp_chunk_tokens: int | None = None,
             ctx_padded: float | None = None, split: bool = False) -> tuple[float, float, tuple]:
        """(pass seconds, slowest stage seconds, the step's key) of a micro-batch of `rows`
        decoding sequences attending to ctx_sum positions in all, and `chunk_tokens` prompt
        tokens attending to attended_sum positions in all; with DP the busiest rank's rows
        and chunk tokens. ctx_padded: the keys a compiled decode step reads (what a measured
        step fitted on them times; the cost model reads each row's own context). split: a
        decode-only tick whose rows' contexts split into groups, which the compiled CPU step leaves
        to the eager step (a measured step that saw such ticks times them as the plain step)."""
        padded = self.fit is not None and self.fit.decode_keys == "padded" and ctx_padded is not None and rows
        key = (rows, bucket(chunk_tokens), bucket(ctx_sum / rows) if rows else 0,
               bucket(attended_sum / chunk_tokens) if chunk_tokens else 0,
               dp_rows, None if dp_chunk_tokens is None else bucket(dp_chunk_tokens),
               bucket(ctx_padded / rows) if padded else None, split)
        hit = self.memo.get(key)
        if hit is None:
            r, c, ctx, attended, dr, dc, width, _ = key
            if self.fit is not None:
                # a tick: one stage's share under PP
                s = self.fit.seconds(r, c, ctx * r, attended * c, None if width is None else width * r, split)
                hit = self.memo[key] = (s * self.cm.l.pp, s, {MEASURED: s})
            else:
                hit = self.memo[key] = self.cm.micro_batch(r, c, ctx=ctx, chunk_ctx=attended, dp_rows=dr,
                                                           dp_chunk_tokens=dc)
        return hit[0], hit[1], key

    def count(self, key: tuple, times: int = 1) -> None:
        self.counts[key] += times

    def breakdown(self) -> dict[str, float]:
        """Seconds by category over the counted ticks (each tick's pass as the cost model split it)."""
        out: dict[str, float] = {}
        for key, n in self.counts.items():
            for name, s in self.memo[key][2].items():
                out[name] = out.get(name, 0.0) + n * s
        return out
