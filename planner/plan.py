"""Plan and Prediction: what the planner returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from atoll.parallel.layout import Layout
from atoll.planner.memory import MemoryFit


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    replicas: int  # copies of the layout serving side by side
    gpus: int  # GPUs in use: replicas x layout.world_size
    concurrency: int
    memory: MemoryFit
    ttft_s: float
    tpot_s: float
    tokens_per_s_per_gpu: float  # output tokens per second per GPU in use
    tokens_per_s_per_user: float  # 1 / TPOT
    decode: dict = field(repr=False, compare=False)  # seconds per category, one decode step
    prefill: dict = field(repr=False, compare=False)  # seconds per category, one prompt
    meets_slo: bool = True
    reason: str = ""
    band: float = 0.0  # relative error TPOT and tokens/s may carry (efficiency.PREDICTION_BAND_TPOT or measured)
    ttft_band: float = 0.0
    tie: bool = False  # within the band of the recommended layout's tokens/s/GPU

    @property
    def name(self) -> str:
        return f"{self.replicas} x {self.layout}" if self.replicas > 1 else str(self.layout)

    @property
    def fits(self) -> bool:
        return self.memory.fits

    def to_dict(self) -> dict:
        gib = 2**30
        m = self.memory
        return {
            "layout": str(self.layout), "replicas": self.replicas, "name": self.name, "gpus": self.gpus,
            "concurrency": self.concurrency, "fits": self.fits,
            "memory_gib": {"used": m.used / gib, "capacity": m.capacity / gib, "weights": m.weights / gib,
                           "kv_cache": m.kv_cache / gib, "activations": m.activations / gib,
                           "buffers": m.buffers / gib, "reserve": m.reserve / gib,
                           "shortfall": m.shortfall / gib},
            "ttft_ms": self.ttft_s * 1e3, "tpot_ms": self.tpot_s * 1e3,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "tokens_per_s_per_user": self.tokens_per_s_per_user,
            "decode_ms": {k: v * 1e3 for k, v in self.decode.items()},
            "prefill_ms": {k: v * 1e3 for k, v in self.prefill.items()},
            "meets_slo": self.meets_slo, "reason": self.reason,
            "band": self.band, "ttft_band": self.ttft_band, "tie_with_recommended": self.tie,
        }


@dataclass(frozen=True)
class Plan:
    model: str
    topology: object  # Topology
    workload: object  # Workload
    predictions: tuple[Prediction, ...]  # every layout evaluated, best first
    recommended: Prediction | None
    placement: object | None  # Placement of the recommended layout's first replica
    reasons: tuple[str, ...]
    evaluated: int  # candidates the search costed

    def to_dict(self) -> dict:
        w = self.workload
        return {
            "model": self.model, "topology": self.topology.describe(),
            "workload": {"isl": w.isl, "osl": w.osl, "concurrency": w.concurrency, "dtype": w.dtype,
                         "kv_dtype": w.kv_dtype},
            "recommended": self.recommended.name if self.recommended else None,
            "reasons": list(self.reasons), "evaluated": self.evaluated,
            "placement": self.placement.to_dict() if self.placement else None,
            "predictions": [p.to_dict() for p in self.predictions],
        }
