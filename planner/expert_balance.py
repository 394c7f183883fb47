"""Expert load imbalance by rank, derived from the gate's statistics and the placement.

The busiest EP rank sets every MoE layer's pace. How busy it is depends on two things: how
skewed the router's load over its experts is, and how the experts are placed on the ranks
(contiguous blocks, or EPLB's placement with R redundant copies: comm/eplb.py, the runtime's
own code). This module puts them together:

- From a recorded load (`atoll generate --expert-load-out FILE`: each MoE layer's tokens per
  logical expert), the placement is computed exactly as the runtime would, and each layer's
  busiest rank over the mean is read off.
- Without one, the loads are drawn from a model of the gate fitted to a published
  measurement: each expert's share of the pairs is log-normal with spread SKEW_SIGMA, and the
  load a step sees drifts from the window the placement was computed from by a log-normal
  factor with spread DRIFT_SIGMA. Both are fitted to TensorRT-LLM's DeepSeek-R1 table
  (efficiency.py: 2.56 by rank without EPLB, 1.11 with 32 redundant experts at EP32); the
  same model then gives the hottest expert at 11.2x the mean, where that table measured 11.95,
  a check the fit was not told about.

Each layer's max/mean is averaged over layers (a step's MoE time is the sum of its layers',
each paced by its own busiest rank). Sampling noise at small batches is left to
moe_cost.busiest_pairs; figures here are at a large batch (REFERENCE_TOKENS a rank)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from atoll.comm.eplb import Placement, imbalance, rebalance
from atoll.comm.experts import expert_split
from atoll.errors import ConfigError
from atoll.planner.efficiency import DRIFT_SIGMA, SKEW_SIGMA

REFERENCE_TOKENS = 256  # tokens a rank a step, as TensorRT-LLM's table measured
MODEL_LAYERS = 24  # layers drawn from the gate model (averaged: a steadier figure)
SEED = 0


def layer_imbalance(loads, ep: int, redundant: int, eplb: bool, *, batch=None, groups: int = 1,
                    islands=None) -> float:
    """One layer's busiest rank over the mean: its placement from `loads` (EPLB's, or the
    contiguous blocks, whose R spare slots copy experts 0..R-1 as the runtime starts), each
    expert's pairs in `batch` (default: `loads` themselves) split evenly over its copies."""
    E = len(loads)
    split = expert_split(E + redundant, ep)
    if eplb:
        placement = rebalance([float(x) for x in loads], split, groups=groups, islands=islands)
    else:
        placement = Placement.initial(E, redundant, ep)
    batch = loads if batch is None else batch
    copies = [len(c) for c in placement.copies()]
    return imbalance(placement.rank_loads([batch[e] / copies[e] for e in placement.phy2log]))


def from_loads(layers, ep: int, redundant: int, eplb: bool, *, groups: int = 1, islands=None) -> float:
    """The mean over layers of each layer's busiest rank over the mean, from recorded loads
    (a list of tokens per logical expert, one a layer). The placement is computed from the same
    loads it is judged on: a window that predicts the next one."""
    counted = [l for l in layers if sum(l) > 0]
    if not counted:
        raise ConfigError("the expert load file counted no tokens")
    return float(np.mean([layer_imbalance(l, ep, redundant, eplb, groups=groups, islands=islands)
                          for l in counted]))


@functools.lru_cache(maxsize=4096)
def modelled(experts: int, top_k: int, ep: int, redundant: int, eplb: bool, *, skew: float = SKEW_SIGMA,
             drift: float = DRIFT_SIGMA, groups: int = 1, islands: tuple | None = None) -> float:
    """The gate model's busiest rank over the mean at `ep` with `redundant` spare slots."""
    rng = np.random.default_rng(SEED)
    pairs = REFERENCE_TOKENS * ep * top_k
    out = []
    for _ in range(MODEL_LAYERS):
        window = rng.lognormal(0.0, skew, experts)
        share = window * rng.lognormal(0.0, drift, experts)
        batch = rng.multinomial(pairs, share / share.sum()).astype(float)
        out.append(layer_imbalance(window / window.mean(), ep, redundant, eplb, batch=batch, groups=groups,
                                   islands=[list(i) for i in islands] if islands else None))
    return float(np.mean(out))


def fit(target_plain: float, target_eplb: float, *, experts: int = 256, top_k: int = 8, ep: int = 32,
        redundant: int = 32) -> tuple[float, float]:
    """(skew, drift) whose model gives `target_plain` without EPLB and `target_eplb` with
    `redundant` slots, at `ep` (bisection on each; the plain figure hardly depends on drift)."""
    def solve(f, lo, hi, target):
        for _ in range(30):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
        return (lo + hi) / 2

    drift = DRIFT_SIGMA
    for _ in range(2):
        skew = solve(lambda s: modelled(experts, top_k, ep, 0, False, skew=s, drift=drift), 0.05, 3.0, target_plain)
        drift = solve(lambda d: modelled(experts, top_k, ep, redundant, True, skew=skew, drift=d), 0.0, 1.5,
                      target_eplb)
    return skew, drift


def read_loads(path) -> tuple[tuple[int, ...], ...]:
    """Tokens per logical expert, one tuple a MoE layer, from an expert load file (the JSON
    `atoll generate --expert-load-out` writes: {"layers": {layer: {"experts": [...]}}})."""
    p = Path(path)
    try:
        report = json.loads(p.read_text())
        layers = report["layers"]
        out = tuple(tuple(int(x) for x in layers[k]["experts"]) for k in sorted(layers, key=int))
    except OSError as e:
        raise ConfigError(f"--expert-loads {path}: cannot read it ({e.strerror})") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--expert-loads {path}: not an expert load file ({type(e).__name__}: {e}); write one "
                          "with `atoll generate --expert-load-out FILE`") from None
    if not out or len({len(l) for l in out}) != 1 or any(x < 0 for l in out for x in l):
        raise ConfigError(f"--expert-loads {path}: every layer must list the same number of experts' tokens, "
                          "none negative")
    return out
