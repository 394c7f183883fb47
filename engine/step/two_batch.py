"""Two-batch overlap (TBO): a step run as two micro-batches, interleaved so that each one's MoE
exchange (dispatch and combine all-to-all, or the gather exchange) flies while the other
computes, as SGLang's --enable-two-batch-overlap and vLLM's dual-batch overlap do.

    tbo = TwoBatchOverlap.build(runner)   # None: off, or a dense model
    if tbo is not None and tbo.takes(mb):
        out = tbo(x, mb, cache)           # the same rows a plain forward gives

The split. A micro-batch's sequences (its chunks, whole) go to two halves, cut where the
tokens before it are nearest half the step's (`split_at`), so a prefill of many prompts and a
decode of many rows both halve; a step of one sequence leaves the second half empty. Each half
is a MicroBatch of its own (its attention metadata, its logits rows), and the outputs are
concatenated in chunk order: the rows a plain forward gives, so sampling is unchanged.

The interleave. Each half runs the model's forward_steps (models/llama.py), a generator that
yields where an MoE layer has started an exchange (comm/pending.py). `interleave` resumes the
two in turns: A's attention, router and dispatch start; B's the same while A's dispatch flies;
A waits for its rows, runs its experts, starts its combine; B does the same while A's combine
flies; A waits for its sums and goes on to the next layer's attention while B's combine flies.
Every rank takes the same turns, so the collectives of each process group start in the same
order everywhere (gloo and NCCL match them by that order). On gloo an exchange runs on the
process group's threads; on NCCL on its stream, the waits stream-ordered (no host sync beyond
the plain path's own: the all-to-all's split sizes, read once per exchange).

When. `--enable-two-batch-overlap` and at least `--tbo-token-threshold` tokens in the step (the
most any DP replica of the stage has: under DP the replicas agree in one small all_reduce, as
they all run the MoE layers together). Steps the CUDA-graph decode step takes stay one batch
(its captured graph is the plain path); the eager steps, prefill above all, split. Below the
threshold the halves' exchanges are latency-bound and each expert reads its weights twice, so
TBO loses: SGLang measured -27% at 32 tokens a GPU, +25% at 256 (docs/two-batch-overlap.md).
"""

from __future__ import annotations

import torch

from atoll.engine.sample.micro_batch import MicroBatch


def split_at(counts: list[int]) -> int:
    """Where to cut sequences of `counts` tokens in two: the index whose tokens before it are
    nearest half of all (ties: the earlier cut), at least 1 when there is anything to cut."""
    total, before, best, at = sum(counts), 0, None, 0
    for i, n in enumerate(counts):
        gap = abs(2 * before - total)
        if i and (best is None or gap < best):
            best, at = gap, i
        before += n
    return at if len(counts) > 1 else len(counts)


def interleave(a, b):
    """Drive two overlapped steps (generators) in turns until both end -> (a's value, b's)."""
    steps, values, live = [a, b], [None, None], [True, True]
    while any(live):
        for i, steps_i in enumerate(steps):
            if not live[i]:
                continue
            try:
                next(steps_i)
            except StopIteration as stop:
                values[i], live[i] = stop.value, False
    return values[0], values[1]


class TwoBatchOverlap:
    def __init__(self, model, ctx, threshold: int, block_size: int):
        self.model, self.ctx, self.threshold, self.block_size = model, ctx, threshold, block_size
        self.steps = 0  # steps run as two micro-batches

    @classmethod
    def build(cls, runner) -> "TwoBatchOverlap | None":
        """The runner's, or None: TBO off, or a model without MoE layers (nothing to overlap)."""
        engine = runner.spec.engine
        if not engine.enable_two_batch_overlap or not getattr(runner.model, "moe_layers", None):
            return None
        if runner.ctx.layout.cp > 1:  # context parallel steps shard their own metadata: one batch
            return None
        if engine.speculative_config is not None:  # a drafter reading the target's hidden rows (MTP's hook
            return None                            # on the last layer) sees one forward: not split yet
        return cls(runner.model, runner.ctx, engine.tbo_token_threshold, engine.block_size)

    def takes(self, mb, eligible: bool = True) -> bool:
        """Whether mb runs as two micro-batches; eligible=False: this rank runs it otherwise (the
        compiled decode step). Under DP every rank of the stage calls this each step it computes."""
        tokens = mb.tokens if eligible else 0
        if self.ctx.layout.dp > 1:  # the replicas agree: the most tokens, and whether all may split
            flags = torch.tensor([-int(eligible), -tokens], device=self.ctx.device)
            veto, most = self.ctx.dp.all_reduce(flags, op="min").tolist()
            return veto == -1 and -most >= self.threshold
        return eligible and tokens >= self.threshold

    def split(self, mb) -> tuple[MicroBatch, MicroBatch, int]:
        """(first half, second half, the first half's tokens)."""
        counts = [c.count for c in mb.chunks]
        at = split_at(counts)
        halves = [MicroBatch.of(part, self.block_size, device=mb.device) for part in (mb.chunks[:at], mb.chunks[at:])]
        return halves[0], halves[1], sum(counts[:at])

    def __call__(self, x: torch.Tensor | None, mb, cache) -> torch.Tensor:
        """x: the stage's input (None on the first stage: the ids are mb's) -> the stage's output
        for the whole of mb: [tokens, hidden], or on the last stage its logits rows."""
        a, b, cut = self.split(mb)
        if x is None:
            xa, xb = a.ids, b.ids
        else:
            xa, xb = x[:cut], x[cut:]
        self.steps += 1
        ya, yb = interleave(self.model.forward_steps(xa, a.meta, cache, True),
                            self.model.forward_steps(xb, b.meta, cache, True))
        return torch.cat([ya, yb])

