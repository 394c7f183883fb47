"""Context parallelism (cp) as the planner costs it: a sequence's tokens and its KV cache split
over cp ranks, costed as the runtime runs it (layers/context_parallel.py).

A cp layout is the runtime's Layout with cp > 1. Rank order inside a pipeline stage: TP innermost, then CP; PP outermost (the runtime's rank grid,
parallel/mesh.py): a cp group's ranks are tp apart, so TP4CP2 keeps its cp pairs inside one
8-GPU node and TP8CP2's cross the network. cp goes only with dp 1 and ep 1, as in the runtime.

What cp changes, per rank of a cp group:
- KV cache: block j of a sequence lives on cp rank j % cp: each rank holds 1/cp of every
  sequence's cache (memory.py).
- Prefill (a whole prompt, or the chunks a step carries): each rank computes the tokens whose
  blocks it holds (a zigzag split at block granularity balances causal attention): 1/cp of the
  GEMM rows, activations and causal attention. Queries travel, not keys: each layer all-gathers
  the step's queries over the cp group, each rank attends every query over its own keys (its
  cached blocks included), and one all-to-all hands each rank the float32 partial outputs and
  log-sum-exps of its own tokens from every rank. The last stage all-gathers the hidden rows
  for the LM head. Nothing overlaps: the collectives are charged serially, on the cp group's link.
- Decode: every cp rank computes every token (the weights are read once per step anyway),
  attends over its 1/cp of each sequence's cache, and one all-gather per layer of the float32
  partials and log-sum-exps lets every rank merge them.
A step mixing chunks with decodes is costed as its chunks the prefill way and its decodes the
decode way (the runtime runs such a step the prefill way: the decode rows are split too, a
difference in GEMM rows that the weights' reads hide).
"""

from __future__ import annotations

import dataclasses

from atoll.errors import ConfigError
from atoll.parallel.layout import Layout

# searched by default (max_cp None) only from this input length: below it the quadratic part of
# a prompt's prefill is small beside its GEMMs (Llama-3.1-70B: attention is ~1/4 of a 32k
# prompt's FLOPs); and at most one cp rank per CP_MIN_SLICE input tokens (rounded up)
CP_FROM_TOKENS = 32768
CP_MIN_SLICE = 16384
PARTIAL_BYTES = 4  # the merged partial outputs and log-sum-exps are float32

def with_cp(layout: Layout, cp: int) -> Layout:
    """The layout with `cp` ranks per sequence: itself at cp 1."""
    if cp == 1:
        return layout
    if layout.dp > 1 or layout.ep > 1:
        raise ConfigError(f"{layout} with cp={cp}: cp does not combine with dp or ep: use TP, CP and PP only")
    return dataclasses.replace(layout, cp=cp)


def max_cp_for(isl: int, max_cp: int | None, gpus: int) -> int:
    """The largest cp the search tries: max_cp when given; by default none below CP_FROM_TOKENS
    input tokens, else one per CP_MIN_SLICE input tokens, rounded up (8 at 128k)."""
    if max_cp is not None:
        if isinstance(max_cp, bool) or not isinstance(max_cp, int) or max_cp < 1:
            raise ConfigError(f"max_cp={max_cp!r} must be a positive integer (1: no context parallelism)")
        return min(max_cp, gpus)
    if isl < CP_FROM_TOKENS:
        return 1
    return max(1, min(gpus, -(-isl // CP_MIN_SLICE)))  # one cp rank per CP_MIN_SLICE tokens, rounded up


def query_bytes_per_token(shapes, tp: int, act_bytes: int) -> float:
    """One token's queries on one TP rank, per layer: its heads x the attention width, in the
    activations' precision (all-gathered over the cp group in a prefill step)."""
    return (shapes.heads / tp) * shapes.attn_dim * act_bytes


def partial_bytes_per_token(shapes, tp: int) -> float:
    """One token's partial attention on one TP rank, per layer: each query head's output row
    and its log-sum-exp, float32 (the decode all-gather and the prefill all-to-all move these)."""
    return (shapes.heads / tp) * (shapes.attn_dim + 1) * PARTIAL_BYTES


def prefill_bytes_per_token(shapes, tp: int, cp: int, act_bytes: int) -> float:
    """Bytes one cp rank sends per prompt token of a step, per layer: its own tokens' queries
    to the cp - 1 others, and the partials it made of the others' tokens."""
    return (cp - 1) / cp * (query_bytes_per_token(shapes, tp, act_bytes) + partial_bytes_per_token(shapes, tp))


def decode_bytes_per_token(shapes, tp: int, cp: int) -> float:
    """Bytes one cp rank sends per decode token, per layer: its partial to the cp - 1 others."""
    return (cp - 1) * partial_bytes_per_token(shapes, tp)


def cp_reason(best, preds) -> str:
    """Why the recommendation has cp or not, beside the best layout of the other kind; "" when
    the search held no cp layout. preds: every prediction, best first."""
    gib = 2**30
    with_cp_ = [p for p in preds if p.layout.cp > 1]
    if not with_cp_:
        return ""
    plain = [p for p in preds if p.layout.cp == 1 and p.fits]
    if best.layout.cp == 1:
        other = next((p for p in with_cp_ if p.fits), None)
        if other is None:
            return "context parallelism: no layout with cp fits"
        return (f"context parallelism: the best layout with cp, {other.name}, gives "
                f"{other.tokens_per_s_per_gpu:.1f} tokens/s/GPU (TTFT {other.ttft_s * 1e3:.0f} ms) against "
                f"{best.tokens_per_s_per_gpu:.1f} (TTFT {best.ttft_s * 1e3:.0f} ms)")
    cp = best.layout.cp
    pf = sum(best.prefill.values())
    moved = sum(v for k, v in best.prefill.items() if k.startswith("CP exchange"))
    text = (f"context parallelism: {best.name} splits each sequence over {cp} ranks: KV "
            f"{best.memory.kv_cache / gib:.1f} GiB per GPU, 1/{cp} of each prompt's tokens and of its causal "
            f"attention per rank; its exchange ({', '.join(k for k in best.prefill if k.startswith('CP exchange'))}) "
            f"is {moved * 1e3:.0f} ms of a {pf * 1e3:.0f} ms prefill")
    if not plain:
        return text + "; no layout without cp fits"
    alt = plain[0]
    return (text + f"; the best layout without cp, {alt.name}: TTFT {alt.ttft_s * 1e3:.0f} ms against "
            f"{best.ttft_s * 1e3:.0f} ms, {alt.tokens_per_s_per_gpu:.1f} tokens/s/GPU against "
            f"{best.tokens_per_s_per_gpu:.1f}")
