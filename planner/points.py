"""One operating point of one replica, costed straight from the cost model (no serving loop):
what wide-EP deployments report, where each phase runs on its own engines at a batch the
operator holds fixed.

    prefill_point("DeepSeek-V3", topo, "DP32EP32", isl=4096, tokens_per_gpu=16384)
    decode_point("DeepSeek-V3", topo, "DP72EP72", batch_per_gpu=256, kv_len=2000)

A prefill point is one pass of `tokens_per_gpu` prompt tokens on every GPU (whole prompts of
`isl` tokens), the input tokens/s per GPU it gives. A decode point is one step of
`batch_per_gpu` sequences on every GPU (on each DP rank, times its tp), each attending to
`kv_len` cached tokens, the output tokens/s per GPU it gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from atoll.models.config import ModelConfig
from atoll.models.presets import resolve_model
from atoll.parallel.layout import Layout
from atoll.parallel.placement import Placement
from atoll.planner.cost import CostModel
from atoll.planner.shapes import shapes as model_shapes
from atoll.planner.workload import Workload


@dataclass(frozen=True)
class Point:
    tokens_per_s_per_gpu: float  # input tokens (prefill) or output tokens (decode) per GPU
    step_s: float  # the pass or step
    breakdown: dict  # seconds by category of that pass or step


def cost_model(model, topology, layout: str, workload: Workload) -> tuple[CostModel, Layout]:
    """The cost model of one replica of `layout` (a preset name or a ModelConfig), and the layout."""
    config = model if isinstance(model, ModelConfig) else resolve_model(str(model))[1]
    lay = Layout.parse(layout).validate(config)
    work = workload.resolved(config)
    placement = Placement.build(lay, topology, allow_cross_island=True)
    cm = CostModel(config, model_shapes(config), topology, work, lay, placement,
                   ranks=min(topology.gpus_per_node, lay.world_size))
    return cm, lay


def prefill_point(model, topology, layout: str, *, isl: int, tokens_per_gpu: int,
                  workload: Workload | None = None) -> Point:
    """Input tokens/s per GPU of one prefill pass holding `tokens_per_gpu` prompt tokens on every
    GPU, in whole prompts of `isl` tokens (at least one per DP rank)."""
    w = Workload(isl=isl, osl=1) if workload is None else workload
    cm, lay = cost_model(model, topology, layout, w)
    per_dp = max(1, math.ceil(tokens_per_gpu * lay.tp * lay.pp / isl))  # a DP rank's prompts
    requests = per_dp * lay.dp
    _, bottleneck, _ = cm.prefill(requests)
    # the busiest stage paces the prompts through (one pass when pp is 1)
    many = cm.stage(0, seqs_per_dp=per_dp, active_dp=lay.dp, new_tokens=isl, ctx=isl, prefill=True)
    tokens = requests * isl
    return Point(tokens / (bottleneck * lay.world_size), bottleneck, dict(many))


def decode_point(model, topology, layout: str, *, batch_per_gpu: int, kv_len: int,
                 workload: Workload | None = None) -> Point:
    """Output tokens/s per GPU of one decode step of `batch_per_gpu` sequences per GPU (per DP
    rank with tp > 1: batch_per_gpu x tp), each attending to `kv_len` tokens."""
    w = Workload(isl=max(1, kv_len - 1), osl=1) if workload is None else workload
    cm, lay = cost_model(model, topology, layout, w)
    rows = batch_per_gpu * lay.world_size // max(1, lay.pp)
    step, slowest, parts = cm.micro_batch(rows, 0, ctx=kv_len, chunk_ctx=0.0)
    step = max(step, lay.pp * slowest) if lay.pp > 1 else step
    return Point(rows / (step * lay.world_size), step, parts)
