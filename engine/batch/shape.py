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
    # keys a compiled decode step reads: every row up to the longest row's context, its block
    # table padded to a power of two (block_bucket); ctx_sum where the block size is not given
    ctx_padded: float = 0.0


def block_bucket(blocks: int, max_blocks: int | None = None) -> int:
    """The power of two >= blocks (at least 2: a width of 1 would be specialised by dynamo),
    capped at max_blocks: the block-table width a compiled decode step runs a batch at."""
    b = 2
    while b < blocks:
        b *= 2
    return b if max_blocks is None else min(b, max_blocks)


def seq_buckets(max_num_seqs: int, smallest: int = 1) -> list[int]:
    """smallest, 2 x smallest, 4 x smallest, ... below max_num_seqs, then max_num_seqs (or
    just smallest, when max_num_seqs is not above it)."""
    out, b = [], smallest
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return out + [max(max_num_seqs, smallest)]


def padded_keys(rows: int, longest: int, block_size: int, max_blocks: int | None = None,
                buckets: list[int] | None = None) -> float:
    """The keys a compiled decode step of `rows` rows reads when its longest row attends to
    `longest` positions: the rows padded to the first of `buckets` that holds them (padding
    rows read the same width), each its block table padded to block_bucket."""
    height = next((b for b in buckets or () if b >= rows), rows)
    return float(height * block_bucket(-(-longest // block_size), max_blocks) * block_size)


def step_shape(chunks, block_size: int | None = None, max_blocks: int | None = None,
               buckets: list[int] | None = None) -> StepShape:
    """The shape of one replica's chunks (engine.batch.scheduler.Scheduled); with block_size,
    also the keys the compiled decode step reads (ctx_padded, padded_keys; buckets as seq_buckets gives them)."""
    rows = tokens = longest = 0
    ctx = attended = 0.0
    for c in chunks:
        if c.start >= len(c.seq.request.prompt_token_ids):  # a decode step (a verify step: a row a position)
            rows += c.count
            ctx += c.count * c.start + c.count * (c.count + 1) / 2  # row k attends to start + k positions
            longest = max(longest, c.start + c.count)
        else:  # a prompt chunk: each token over the positions before it
            tokens += c.count
            attended += c.count * (c.start + c.count / 2)
    padded = padded_keys(rows, longest, block_size, max_blocks, buckets) if block_size and rows else ctx
    return StepShape(rows, tokens, ctx, attended, padded)
