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

import dataclasses

from atoll.errors import ConfigError
from atoll.models.config import ModelConfig
from atoll.models.presets import resolve_model
from atoll.parallel.placement import Placement
from atoll.planner import moe_options
from atoll.planner.context import max_cp_for
from atoll.planner.memory import memory_fit
from atoll.planner.plan import Plan, Prediction
from atoll.planner.recommend import explain, recommend
from atoll.planner.search import enumerate_layouts, evaluate, evaluate_all, parse_candidate
from atoll.planner.shapes import shapes as model_shapes
from atoll.planner.workload import Workload


def plan_layouts(model, topology, workload: Workload, *, ttft_ms: float | None = None,
                 tpot_ms: float | None = None, layouts: list[str] | None = None,
                 allow_cross_island: bool = False, max_cp: int | None = None, progress=None,
                 eplb=moe_options.FIXED, tbo=moe_options.FIXED) -> Plan:
    """`model`: a preset name, a config path, or a ModelConfig. `layouts`: only these
    ("TP8PP2", "2 x TP8", "TP8CP2"); otherwise every layout the search admits, context
    parallelism up to max_cp (None: context.max_cp_for's default). progress(done, total):
    called as the layouts are costed (a progress bar: planner/progress.py)."""
    return plan_sweep(model, topology, [workload], ttft_ms=ttft_ms, tpot_ms=tpot_ms, layouts=layouts,
                      allow_cross_island=allow_cross_island, max_cp=max_cp, progress=progress, eplb=eplb,
                      tbo=tbo)[0]


def plan_sweep(model, topology, workloads: list[Workload], *, ttft_ms: float | None = None,
               tpot_ms: float | None = None, layouts: list[str] | None = None,
               allow_cross_island: bool = False, max_cp: int | None = None, progress=None,
               eplb=moe_options.FIXED, tbo=moe_options.FIXED) -> list[Plan]:
    """plan_layouts for each workload (a --concurrency sweep), every layout costed once for all.
    eplb, tbo: moe_options.AUTO lets the search choose EPLB and two-batch overlap per EP layout
    (`atoll plan` does); FIXED costs them as each workload has them."""
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
    every, whys = _with_moe_options(config, sh, topology, workloads, cands, every, allow_cross_island, eplb, tbo)
    plans = []
    for workload, preds, why in zip(workloads, every, whys):
        preds, best, reasons = recommend(preds, ttft_ms=ttft_ms, tpot_ms=tpot_ms)
        if best is not None and why.get(best.name):
            reasons.insert(1, f"{best.shown}: {why[best.name]}")
        placement = Placement.build(best.layout, topology, allow_cross_island=allow_cross_island) if best else None
        plans.append(Plan(model=name, topology=topology, workload=workload, predictions=tuple(preds),
                          recommended=best, placement=placement, reasons=tuple(reasons), evaluated=len(cands)))
    return plans


def _with_moe_options(config, sh, topology, workloads, cands, every, allow_cross_island, eplb, tbo):
    """Each EP layout's prediction replaced by its best MoE options' (moe_options.py); with
    each workload's {name: why} for the layouts whose options were chosen."""
    whys: list[dict] = [{} for _ in workloads]
    open_options = eplb == moe_options.AUTO or tbo == moe_options.AUTO
    ep_cands = [i for i, (lay, _) in enumerate(cands) if config.is_moe and lay.ep > 1]
    if not open_options or not ep_cands:
        return every, whys
    by_ep: dict = {}
    for i in ep_cands:
        by_ep.setdefault(cands[i][0].ep, []).append(i)
    for members in by_ep.values():
        layout = cands[members[0]][0]
        tried = [(wi, v) for wi, w in enumerate(workloads)
                 for v in moe_options.variants(w, config, layout, eplb=eplb, tbo=tbo)[1:]]
        if not tried:
            continue
        # every workload's variants at once: those that differ in concurrency alone share their steps
        preds = evaluate_all(config, sh, topology, [v for _, v in tried], [cands[i] for i in members],
                             allow_cross_island=allow_cross_island)
        for wi in range(len(workloads)):
            mine = [(v, p) for (wj, v), p in zip(tried, preds) if wj == wi]
            for j, i in enumerate(members):
                plain = moe_options.Chosen(workloads[wi], every[wi][i])
                pick = moe_options.best([plain] + [moe_options.Chosen(v, p[j]) for v, p in mine])
                if pick is plain:
                    continue
                lay = cands[i][0]
                options = tuple((k, getattr(pick.workload, k)) for k in ("eplb", "redundant_experts",
                                                                         "two_batch_overlap"))
                every[wi][i] = dataclasses.replace(pick.prediction, options=options)
                whys[wi][every[wi][i].name] = moe_options.why(pick, plain.prediction, sh, lay, topology)
    return every, whys


__all__ = ["Plan", "Prediction", "Workload", "enumerate_layouts", "evaluate", "evaluate_all", "explain",
           "plan_layouts", "plan_sweep", "recommend"]
