"""The layout planner: search every layout, fit memory, cost each step, recommend one.

    from atoll.planner import plan_layouts, plan_sweep, Workload
    plan = plan_layouts("DeepSeek-V3", load_topology("dgx-h200", nodes=2), Workload(concurrency=1))
    plan.recommended.name, plan.reasons, plan.placement.node_of(9)
    plans = plan_sweep("DeepSeek-V3", topology, [Workload(concurrency=c) for c in (1, 64, 256)])
    plan_layouts("Llama-3.1-70B", topology, Workload(isl=130816, concurrency=1), max_cp=4)  # cp 1..4

Context parallelism (cp, planner/context.py) is searched by default only for long prompts
(context.CP_FROM_TOKENS input tokens and more); max_cp=1 leaves it out, max_cp=N searches up to N.

A sweep costs each layout once for all its workloads (search.evaluate_all): ask for the
concurrencies together rather than one plan_layouts each.
"""

from __future__ import annotations

from atoll.errors import ConfigError
from atoll.models.config import ModelConfig
from atoll.models.presets import resolve_model
from atoll.parallel.placement import Placement
from atoll.planner.context import max_cp_for
from atoll.planner.memory import memory_fit
from atoll.planner.plan import Plan, Prediction
from atoll.planner.recommend import explain, recommend
from atoll.planner.search import enumerate_layouts, evaluate, evaluate_all, parse_candidate
from atoll.planner.shapes import shapes as model_shapes
from atoll.planner.workload import Workload


def plan_layouts(model, topology, workload: Workload, *, ttft_ms: float | None = None,
                 tpot_ms: float | None = None, layouts: list[str] | None = None,
                 allow_cross_island: bool = False, max_cp: int | None = None, progress=None) -> Plan:
    """`model`: a preset name, a config path, or a ModelConfig. `layouts`: only these
    ("TP8PP2", "2 x TP8", "TP8CP2"); otherwise every layout the search admits, context
    parallelism up to max_cp (None: context.max_cp_for's default). progress(done, total):
    called as the layouts are costed (a progress bar: planner/progress.py)."""
    return plan_sweep(model, topology, [workload], ttft_ms=ttft_ms, tpot_ms=tpot_ms, layouts=layouts,
                      allow_cross_island=allow_cross_island, max_cp=max_cp, progress=progress)[0]


def plan_sweep(model, topology, workloads: list[Workload], *, ttft_ms: float | None = None,
               tpot_ms: float | None = None, layouts: list[str] | None = None,
               allow_cross_island: bool = False, max_cp: int | None = None, progress=None) -> list[Plan]:
    """plan_layouts for each workload (a --concurrency sweep), every layout costed once for all."""
    for slo, v in (("ttft_ms", ttft_ms), ("tpot_ms", tpot_ms)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf")):
            raise ConfigError(f"{slo}={v!r}: an SLO must be a positive number of milliseconds")
    name, config = (getattr(model, "model_type", "model"), model) if isinstance(model, ModelConfig) \
        else resolve_model(str(model))
    workloads = [w.resolved(config) for w in workloads]  # "auto" precisions from the checkpoint; isl + osl in context
    sh = model_shapes(config)
    if layouts:
        cands = [parse_candidate(t, topology.num_gpus) for t in layouts]
        for layout, _ in cands:
            layout.validate(config)
        allow_cross_island = True  # layouts named by the user may cross islands: they asked
    else:
        most_cp = min(max_cp_for(w.isl, max_cp, topology.num_gpus) for w in workloads)
        cands = enumerate_layouts(config, topology, allow_cross_island=allow_cross_island, max_cp=most_cp)
        if most_cp > 1:  # cp copies the weights: where they alone do not fit, no cp makes room
            cands = [(lay, reps) for lay, reps in cands if lay.cp == 1
                     or memory_fit(config, sh, topology, workloads[0], lay, 1).weights_fit]
    every = evaluate_all(config, sh, topology, workloads, cands, allow_cross_island=allow_cross_island,
                         progress=progress)
    plans = []
    for workload, preds in zip(workloads, every):
        preds, best, reasons = recommend(preds, ttft_ms=ttft_ms, tpot_ms=tpot_ms)
        placement = Placement.build(best.layout, topology, allow_cross_island=allow_cross_island) if best else None
        plans.append(Plan(model=name, topology=topology, workload=workload, predictions=tuple(preds),
                          recommended=best, placement=placement, reasons=tuple(reasons), evaluated=len(cands)))
    return plans


__all__ = ["Plan", "Prediction", "Workload", "enumerate_layouts", "evaluate", "evaluate_all", "explain",
           "plan_layouts", "plan_sweep", "recommend"]
