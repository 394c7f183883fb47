"""Weight bytes per GPU under `--quantization` (int8 or fp8), counted by the runtime's own rule:
models.quantize.rank_weight_bytes builds the stage's model on the meta device, makes the
quantized parameters and scales the runner makes, and sums them. So the planner charges what
the ranks allocate (which weights stay float, the per-row and per-128-column scales) without
a second copy of the rule. Without --quantization the planner keeps its parameter arithmetic
(planner/memory.py)."""

from __future__ import annotations

import torch

from atoll.models.quantize import rank_weight_bytes

_CACHE: dict = {}


def stage_weight_bytes(config, layout, stage: int, workload) -> int:
    """Bytes on one GPU of pipeline stage `stage` (its first rank: every rank of a stage holds
    the same sizes), the decoder layers computing in bf16 (fp32 under fp32 weights)."""
    dtype = torch.float32 if workload.dtype == "fp32" else torch.bfloat16
    key = (id(config), str(layout), stage, dtype, workload.quantization)
    if key not in _CACHE:
        rank = stage * layout.stage_size
        _CACHE[key] = (config, rank_weight_bytes(config, layout, rank, dtype=dtype,
                                                 quantization=workload.quantization))
    return _CACHE[key][1]
