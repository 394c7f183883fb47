"""What a micro-batch asks of a step, in the terms a step's time depends on: the rows decoding,
the prompt-chunk tokens beside them, and the positions each attends to (a decoding row over its
whole context; a chunk's token over the positions before it in its prompt; a speculative
verify step's positions each a decoding row of its own, as the decode step runs them). Plain Python over the scheduler's chunks: the rank loop
records it beside each tick's seconds when asked (EngineCore's trace, read by `atoll calibrate
--steps`), and the simulator times its ticks by it (planner/sim).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepShape:
    rows: int = 0  # decoding rows: a sequence's next token, and with a draft one per drafted token too
    chunk_tokens: int = 0  # prompt-chunk tokens
    ctx_sum: float = 0.0  # positions the decoding rows attend to, in all
    attended_sum: float = 0.0  # positions the chunk tokens attend to, in all


def step_shape(chunks) -> StepShape:
    """The shape of one replica's chunks (engine.batch.scheduler.Scheduled)."""
    rows = tokens = 0
    ctx = attended = 0.0
    for c in chunks:
        if c.start >= len(c.seq.request.prompt_token_ids):  # a decode step (a verify step: a row a position)
            rows += c.count
            ctx += c.count * c.start + c.count * (c.count + 1) / 2  # row k attends to start + k positions
        else:  # a prompt chunk: each token over the positions before it
            tokens += c.count
            attended += c.count * (c.start + c.count / 2)
    return StepShape(rows, tokens, ctx, attended)
