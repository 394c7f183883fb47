"""The SLO search's candidates, pruned by the analytic model before any is simulated.

Every layout the planner searches (search.enumerate_layouts) is costed analytically at a few
batch sizes per replica (search.evaluate_all: one table of steps per layout, so this is as fast
as `atoll plan`). A layout leaves the search when its weights do not fit, or when even one
request alone misses an SLO by more than the analytic model's error band: its unloaded TPOT
(decode at batch 1) or its unloaded TTFT (one prompt's prefill). The rest are ranked by the
analytic output tokens/s per GPU at the largest batch whose TPOT still meets the SLO, and the
best few become finalists, colocated (replicas behind the router) and disaggregated (xPyD:
prefill layouts ranked by prompt tokens/s per GPU, decode layouts by that same score).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from atoll.planner.search import enumerate_layouts, evaluate_all
from atoll.planner.shapes import shapes as model_shapes
from atoll.planner.workload import Workload

BATCHES = (1, 4, 16, 64, 256)  # requests per replica the analytic model is asked about
PRUNE_MARGIN = 1.5  # a layout is dropped only when alone it misses an SLO by more than this


@dataclass(frozen=True)
class Scored:
    """One layout as the analytic model sees it."""
    layout: object  # Layout
    replicas: int  # copies that fill the cluster
    fits: bool
    tpot1_s: float  # decode step at batch 1
    prefill_s: float  # one prompt's prefill, alone
    score: float  # output tokens/s per GPU at the largest batch meeting the TPOT SLO (0: none)
    batch: int  # that batch, per replica
    why: str  # why it was dropped ("" when kept)

    @property
    def world(self) -> int:
        return self.layout.world_size

    @property
    def prefill_per_gpu(self) -> float:
        """Prompts per second per GPU, one at a time."""
        return 1.0 / (self.prefill_s * self.world) if self.prefill_s > 0 else math.inf


def score_layouts(config, topology, *, isl: int, osl: int, dtype: str, kv_dtype: str, slos_ms: dict,
                  layouts=None, progress=None) -> list[Scored]:
    """Every candidate layout scored (the module's docstring); layouts: [(Layout, replicas)] to
    score instead of every one the search admits."""
    cands = layouts if layouts is not None else enumerate_layouts(config, topology)
    if not cands:
        return []
    sh = model_shapes(config)
    works = [Workload(isl=isl, osl=osl, concurrency=b, dtype=dtype, kv_dtype=kv_dtype).resolved(config)
             for b in BATCHES]
    # one replica of each layout at each batch; a layout's steps are costed once for all batches
    every = evaluate_all(config, sh, topology, works, [(lay, 1) for lay, _ in cands], progress=progress)
    per_batch = list(zip(BATCHES, every))
    tpot_slo = slos_ms.get("tpot", math.inf) / 1e3
    ttft_slo = slos_ms.get("ttft", math.inf) / 1e3
    out = []
    for i, (layout, reps) in enumerate(cands):
        first = per_batch[0][1][i]
        prefill = sum(first.prefill.values())
        score, batch = 0.0, 0
        for b, preds in per_batch:
            p = preds[i]
            if p.fits and p.tpot_s <= tpot_slo:
                score, batch = max(score, b * osl / (p.tpot_s * osl + prefill) / layout.world_size), b
        why = ""
        if not first.fits:
            why = f"does not fit: short by {first.memory.shortfall / 2**30:.1f} GiB per GPU"
        elif first.tpot_s > PRUNE_MARGIN * tpot_slo:
            why = f"alone, TPOT {first.tpot_s * 1e3:.1f} ms > {PRUNE_MARGIN:g} x the SLO"
        elif prefill > PRUNE_MARGIN * ttft_slo:
            why = f"alone, TTFT {prefill * 1e3:.0f} ms > {PRUNE_MARGIN:g} x the SLO"
        out.append(Scored(layout, reps, first.fits, first.tpot_s, prefill, score, batch, why))
    return out


def finalists(scored: list[Scored], count: int, gpus: int, *,
              by_size: bool = False) -> tuple[list[Scored], list[Scored], list[Scored]]:
    """(colocated, prefill, decode) finalists: the best `count` kept layouts by score (by the
    unloaded TPOT where none has a score), and with by_size (a request rate to meet with the
    fewest GPUs) the best of every smaller size too; for xPyD the best prefill layouts of at most half the
    cluster by prompts/s per GPU, and the best decode layouts that fit beside the smallest of them."""
    kept = [s for s in scored if not s.why]
    by_score = sorted(kept, key=lambda s: (-s.score, s.tpot1_s, s.world))
    colocated = by_score[:count]
    if by_size and colocated:
        sizes = {s.world for s in colocated}
        for s in by_score:
            if s.world < min(sizes):
                colocated.append(s)
                sizes.add(s.world)
    if not colocated:  # every layout misses alone: the one that fits and misses least, to name the closest
        fitting = sorted((s for s in scored if s.fits), key=lambda s: (s.tpot1_s, s.prefill_s))
        return fitting[:1], [], []
    prefill = sorted((s for s in kept if s.world <= gpus // 2), key=lambda s: (-s.prefill_per_gpu, s.world))
    prefill = prefill[:max(1, count // 2)]
    room = gpus - min((s.world for s in prefill), default=gpus)
    decode = [s for s in by_score if s.world <= room][:max(1, count // 2)]
    return colocated, prefill, decode


def splits(wp: int, wd: int, gpus: int, *, fill: bool, most: int = 4) -> list[tuple[int, int]]:
    """(prefill engines, decode engines) of wp and wd GPUs each within `gpus`: with fill, the
    splits that leave fewer GPUs idle than one more engine would take (at most `most`, spread
    from prefill-light to prefill-heavy); else every split, fewest GPUs first."""
    pairs = [(x, y) for x in range(1, gpus // wp + 1) for y in range(1, (gpus - x * wp) // wd + 1)]
    if fill:
        pairs = [(x, y) for x, y in pairs if gpus - x * wp - y * wd < min(wp, wd)]
        if len(pairs) > most:
            step = (len(pairs) - 1) / (most - 1)
            pairs = [pairs[round(i * step)] for i in range(most)]
        return pairs
    return sorted(pairs, key=lambda xy: (xy[0] * wp + xy[1] * wd, xy))
