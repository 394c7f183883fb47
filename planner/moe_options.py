"""The MoE engine options the search chooses like a layout: EPLB with R redundant expert slots,
and two-batch overlap (TBO).

For each layout with EP > 1, the workload is costed again with each option the user left open
(`atoll plan --enable-eplb auto --two-batch-overlap auto`, the default), and the layout keeps the
variant with the most tokens/s/GPU among those that fit. EPLB is tried with one spare slot a rank
(R = ep; `--num-redundant-experts R` fixes another): more copies balance better
(planner/expert_balance.py), but every copy is an expert's weights more on each rank, and at
decode sizes its reads; at one a rank the gate model is already within a few percent of the
best it reaches (1.08x at EP16 with 16 or 32 spare slots). The chosen options go into
the layout's name and its "why": how far EPLB brought the busiest rank down, what TBO saved."""

from __future__ import annotations

import dataclasses

from atoll.errors import ConfigError
from atoll.planner.expert_balance import read_loads
from atoll.planner.moe_cost import expert_imbalance

AUTO = "auto"
FIXED = "fixed"  # the option as the workload has it


def variants(workload, config, layout, *, eplb=AUTO, tbo=AUTO) -> list:
    """The workloads to cost `layout` under: the given one first, then every open option's.
    eplb: AUTO, or a fixed (on, redundant) pair; tbo: AUTO or a bool."""
    if not config.is_moe or layout.ep <= 1:
        return [workload]
    balances = [(workload.eplb, workload.redundant_experts)] if eplb != AUTO else \
        [(False, 0), (True, layout.ep)]
    overlaps = [workload.two_batch_overlap] if tbo != AUTO else [False, True]
    out = [workload]
    for on, r in balances:
        for t in overlaps:
            w = dataclasses.replace(workload, eplb=on, redundant_experts=r, two_batch_overlap=t)
            if w not in out:
                out.append(w)
    return out


def rebalance_cost(shapes, workload, layout, topology) -> tuple[float, float, str]:
    """(bytes, seconds, link) of the largest rebalance: every expert slot of a rank refilled
    from a peer, each MoE layer's, over the slowest link of the EP group (the runtime moves one
    layer a step beside serving: engine/rank/expert_moves.py). A real one moves fewer: the
    placement keeps what it can."""
    slots = shapes.experts_per_rank(layout.ep, workload.redundant_experts)
    layers = sum(1 for dense in shapes.dense_layers if not dense)
    moved = slots * shapes.expert / layout.moe_tp * workload.weight_bytes * layers / layout.pp
    link = topology.network if layout.world_size > topology.gpus_per_node else topology.island_link
    return moved, moved / (link.gb_s * 1e9), link.kind


def why(chosen, plain, shapes, layout, topology=None) -> str:
    """What the chosen options bought over the same layout without them (the plain workload's
    prediction `plain`), in a clause; "" when nothing was chosen."""
    w, parts = chosen.workload, []
    if w.eplb:
        before = expert_imbalance(dataclasses.replace(w, eplb=False, redundant_experts=0), shapes, layout.ep)
        after = expert_imbalance(w, shapes, layout.ep)
        parts.append(f"EPLB{f' with {w.redundant_experts} spare slots' if w.redundant_experts else ''} brings the "
                     f"busiest EP rank from {before:.2f}x to {after:.2f}x the mean")
        if topology is not None:
            moved, seconds, kind = rebalance_cost(shapes, w, layout, topology)
            parts.append(f"a rebalance moves up to {moved / 2**30:.1f} GiB a rank ({seconds:.1f} s over {kind}, one "
                         "layer a step beside serving)")
    if w.two_batch_overlap:
        parts.append("two-batch overlap hides the MoE exchange under the other micro-batch's compute")
    if not parts:
        return ""
    gain = chosen.prediction.tokens_per_s_per_gpu / plain.tokens_per_s_per_gpu if plain.tokens_per_s_per_gpu else 1.0
    return f"{'; '.join(parts)} ({gain:.2f}x the tokens/s/GPU without them)"


@dataclasses.dataclass(frozen=True)
class Chosen:
    workload: object
    prediction: object


def best(options: list[Chosen]) -> Chosen:
    """The variant that fits with the most tokens/s/GPU (ties: the first, the fewest options)."""
    fitting = [c for c in options if c.prediction.fits and c.prediction.sustainable] or options
    return max(fitting, key=lambda c: c.prediction.tokens_per_s_per_gpu)


@dataclasses.dataclass(frozen=True)
class Choices:
    """`atoll plan`'s MoE flags: the workload fields they fix, and what the search leaves open."""

    fields: dict
    eplb: object = AUTO  # AUTO, or fixed by the workload's fields
    tbo: object = AUTO


def from_flags(enable_eplb: str, redundant: int | None, two_batch_overlap: str, expert_loads: str | None) -> Choices:
    """--enable-eplb auto|on|off, --num-redundant-experts R, --two-batch-overlap auto|on|off,
    --expert-loads FILE as the workload's fields and the options left to the search."""
    if redundant is not None and enable_eplb == "off":
        raise ConfigError(f"--num-redundant-experts {redundant} needs EPLB: drop --enable-eplb off")
    fields: dict = {}
    eplb = tbo = AUTO
    if redundant is not None or enable_eplb == "on":
        fields |= {"eplb": True, "redundant_experts": redundant or 0}
        eplb = FIXED
    elif enable_eplb == "off":
        eplb = FIXED
    if two_batch_overlap != AUTO:
        fields["two_batch_overlap"] = two_batch_overlap == "on"
        tbo = FIXED
    if expert_loads:
        fields["expert_loads"] = read_loads(expert_loads)
    return Choices(fields, eplb, tbo)
