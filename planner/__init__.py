"""The layout planner: search every layout, fit memory, cost each step, recommend one.

    from atoll.planner import plan_layouts, Workload
    plan = plan_layouts("DeepSeek-V3", load_topology("dgx-h200", nodes=2), Workload(concurrency=1))
    plan.recommended.name, plan.reasons, plan.placement.node_of(9)
"""

from __future__ import annotations

from atoll.parallel.placement import Placement
from atoll.planner.plan import Plan, Prediction
from atoll.planner.recommend import explain, recommend
from atoll.planner.search import enumerate_layouts, evaluate, parse_candidate
from atoll.planner.shapes import shapes as model_shapes
from atoll.planner.workload import Workload


def plan_layouts(model, topology, workload: Workload, *, ttft_ms: float | None = None,
                 tpot_ms: float | None = None, layouts: list[str] | None = None,
                 allow_cross_island: bool = False) -> Plan:
    """`model`: a preset name, a config path, or a ModelConfig. `layouts`: only these
    ("TP8PP2", "2 x TP8"); otherwise every layout the search admits."""
    from atoll.errors import ConfigError
    from atoll.models.config import ModelConfig
    from atoll.models.presets import resolve_model

    for slo, v in (("ttft_ms", ttft_ms), ("tpot_ms", tpot_ms)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf")):
            raise ConfigError(f"{slo}={v!r}: an SLO must be a positive number of milliseconds")
    name, config = (getattr(model, "model_type", "model"), model) if isinstance(model, ModelConfig) \
        else resolve_model(str(model))
    workload = workload.resolved(config)  # "auto" precisions from the checkpoint; isl + osl in context
    sh = model_shapes(config)
    if layouts:
        cands = [parse_candidate(t, topology.num_gpus) for t in layouts]
        for layout, _ in cands:
            layout.validate(config)
        allow_cross_island = True  # layouts named by the user may cross islands: they asked
    else:
        cands = enumerate_layouts(config, topology, allow_cross_island=allow_cross_island)
    preds = [evaluate(config, sh, topology, workload, lay, reps, allow_cross_island=allow_cross_island)
             for lay, reps in cands]
    preds, best, reasons = recommend(preds, ttft_ms=ttft_ms, tpot_ms=tpot_ms)
    placement = Placement.build(best.layout, topology, allow_cross_island=allow_cross_island) if best else None
    return Plan(model=name, topology=topology, workload=workload, predictions=tuple(preds),
                recommended=best, placement=placement, reasons=tuple(reasons), evaluated=len(cands))


__all__ = ["Plan", "Prediction", "Workload", "enumerate_layouts", "evaluate", "explain",
           "plan_layouts", "recommend"]
