"""Two-batch overlap (TBO) in the cost model, by step size (the runtime: engine/step/two_batch.py).

A step of an MoE layer as two micro-batches of half the sequences each: one's dispatch and
combine run under the other's attention and experts (DeepSeek's profile-data README, "two
micro-batches"; SGLang's large-scale EP blog). Each half reads the layer's weights again and pays
each collective's latency again, so with C(n) the layer's work for n tokens and M(n) its ep
exchange:

    one batch:      C(n) + M(n)
    two halves:     max(2 C(n/2), 2 M(n/2))    (each half's exchange under the other's work)

At decode sizes C is weight-bound, 2 C(n/2) is about 2 C(n), and TBO loses (SGLang measured
-27% at 32 tokens a GPU); with enough tokens 2 C(n/2) is about C(n) and the exchange hides
(+25% at 256 a GPU in decode, +27-35% in prefill). In the engines
the halves' overlap falls short of that max: the exchange shares the GPU with the work it hides
under (DeepEP's normal kernels run on SMs taken from the GEMMs, `Buffer.set_num_sms`) and its
dispatch waits on a CPU sync for the received token counts (DeepEP README, normal kernels), so
a layer gains at most the best that SGLang measured (most_gain). As the runtime's
--tbo-token-threshold switches it by size, the planner takes the halves only where they are faster (the OVERLAP
category: seconds taken off, never added), and `crossover` gives the step size from which
they are.
"""

from __future__ import annotations

from atoll.planner.categories import OVERLAP
from atoll.planner.parts import vmax, vmin

# SGLang's published two-batch overlap figures (DeepSeek-V3, large-scale EP on H100s;
# https://lmsys.org/blog/2025-05-05-large-scale-ep, "Two-batch Overlap", as issue 38 quotes it):
# decode throughput at these tokens per GPU, TBO on over off
SGLANG_DECODE = {32: 0.73, 256: 1.25}
SGLANG_PREFILL = (1.27, 1.35)  # prefill throughput, on over off, across its measured sizes


def most_gain(prefill: bool) -> float:
    """The most an MoE layer gains from two halves (one batch's seconds over the halves'): the
    best SGLang measured, 1.35x in prefill and 1.25x in decode; the ideal max() above gives
    1.5-1.7x on its EP32 prefill."""
    return max(SGLANG_PREFILL) if prefill else max(SGLANG_DECODE.values())


def halves(kw: dict) -> dict:
    """A layer's arguments (CostModel.layer) for one of two micro-batches: half the sequences
    and half the prompt-chunk tokens of each DP rank (the DP ranks stay)."""
    return kw | {"seqs_per_dp": kw["seqs_per_dp"] / 2, "prompt_tokens": kw.get("prompt_tokens", 0.0) / 2,
                 "prompt_rows": kw.get("prompt_rows", 0.0) / 2}


def apply(one, room, half, seqs, most: float = 1e9) -> None:
    """Adds to `one` (a layer's seconds as one batch) what two halves take off, where they are
    faster: at most `room`'s second, the exchange the layer's own work can hide (the longer of
    the two, as DeepSeek's profile describes it), and at most what a gain of `most` takes off;
    half: one half's (seconds, room); seqs: sequences a DP rank (the runtime splits whole
    sequences: one cannot be split)."""
    parts, (moved, _) = half
    split = vmax(2.0 * (parts.total() - moved), 2.0 * moved)
    gain = vmin(vmin(one.total() - split, room[1]), one.total() * (1.0 - 1.0 / most))
    one.add(OVERLAP, -vmax(gain, 0.0), when=seqs >= 2)


def step_ratio(plain_cm, tbo_cm, tokens_per_gpu: int, *, prefill: bool = False) -> float:
    """One step's seconds without TBO over with it (above 1: TBO faster) at `tokens_per_gpu`
    tokens on each DP rank: decode rows, or prefill tokens as `tokens_per_gpu` / isl prompts.
    plain_cm, tbo_cm: CostModels of one deployment, their workloads' two_batch_overlap off and on."""
    dp = plain_cm.l.dp
    if prefill:
        isl = plain_cm.w.isl
        kw = dict(seqs_per_dp=max(tokens_per_gpu / isl, 1.0), active_dp=dp, new_tokens=isl, ctx=isl, prefill=True)
        t = [sum(cm.stage(i, **kw).total() for i in range(cm.l.pp)) for cm in (plain_cm, tbo_cm)]
    else:
        t = [cm.decode(tokens_per_gpu * dp)[0] for cm in (plain_cm, tbo_cm)]
    return t[0] / t[1]


def forced_ratio(plain_cm, tokens_per_gpu: int) -> float:
    """An MoE layer's decode step as one batch over as two halves, taken at any size (as a fixed
    switch would run it): below 1 where the halves lose, which `apply` leaves out."""
    kw = dict(seqs_per_dp=float(tokens_per_gpu), active_dp=plain_cm.l.dp, new_tokens=1,
              ctx=float(plain_cm.w.isl + plain_cm.w.osl / 2), prefill=False)
    one, room = plain_cm._layer(False, **kw)
    half, (moved, _) = plain_cm._layer(False, **halves(kw))
    split = float(vmax(2.0 * (half.total() - moved), 2.0 * moved))
    gain = min(one.total() - split, float(room[1]), one.total() * (1.0 - 1.0 / most_gain(False)))
    return one.total() / (one.total() - gain)


def crossover(plain_cm, sizes) -> int | None:
    """The smallest of `sizes` (decode tokens per GPU) from which an MoE layer is faster as two
    halves at every larger size given (None: at none)."""
    at = None
    for n in sorted(sizes, reverse=True):
        if forced_ratio(plain_cm, n) <= 1.0:
            break
        at = n
    return at
