"""What a micro-batch asks of a step, in the terms a step's time depends on: the rows decoding,
the prompt-chunk tokens beside them, and the positions each attends to (a decoding row over its
whole context; a chunk's token over the positions before it in its prompt; a draft's tokens as
chunk tokens after the row's own). Plain Python over the scheduler's chunks: the rank loop
records it beside each tick's seconds when asked (EngineCore's trace, read by `atoll calibrate
--steps`), and the simulator times its ticks by it (planner/sim).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepShape:
    rows: int = 0  # sequences decoding (their next token, and a draft's if any)
    chunk_tokens: int = 0  # prompt-chunk and draft tokens
    ctx_sum: float = 0.0  # positions the decoding rows attend to, in all
    attended_sum: float = 0.0  # positions the chunk tokens attend to, in all


def step_shape(chunks) -> StepShape:
    """The shape of one replica's chunks (engine.batch.scheduler.Scheduled)."""
    rows = tokens = 0
    ctx = attended = 0.0
    for c in chunks:
        if c.start >= len(c.seq.request.prompt_token_ids):  # a decode step (and its draft)
            rows += 1
            ctx += c.start + c.count
            tokens += c.count - 1
            attended += (c.count - 1) * (c.start + c.count / 2)
        else:  # a prompt chunk: each token over the positions before it
            tokens += c.count
            attended += c.count * (c.start + c.count / 2)
    return StepShape(rows, tokens, ctx, attended)
