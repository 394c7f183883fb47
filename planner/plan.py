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
    ttft_s: float  # steady serving, queueing included (planner/serving.py); inf when not sustainable
    tpot_s: float  # mean decode step in steady serving, prompt chunks mixed in
    tokens_per_s_per_gpu: float  # output tokens per second per GPU in use
    tokens_per_s_per_user: float  # 1 / TPOT
    decode: dict = field(repr=False, compare=False)  # seconds per category, one (mean) decode step
    prefill: dict = field(repr=False, compare=False)  # seconds per category, one prompt
    meets_slo: bool = True
    reason: str = ""
    band: float = 0.0  # relative error TPOT and tokens/s may carry (efficiency.PREDICTION_BAND_TPOT or measured)
    ttft_band: float = 0.0
    tie: bool = False  # within the band of the recommended layout's tokens/s/GPU
    arrival_rate: float = 0.0  # requests/s the cluster serves in steady state
    offered_rate: float | None = None  # the workload's request_rate (open loop); None: closed loop
    prefill_load: float = 0.0  # ρ of each replica's prefill: prompt work offered over what it can do
    overload: str = ""  # why the offered load is not sustainable; "" when it is
    options: tuple = ()  # the MoE engine options chosen for it (planner/moe_options.py): (workload field, value)

    @property
    def sustainable(self) -> bool:
        return not self.overload

    @property
    def name(self) -> str:
        return f"{self.replicas} x {self.layout}" if self.replicas > 1 else str(self.layout)

    @property
    def moe(self) -> str:
        """The chosen MoE options in a few words: "EPLB+16, TBO"; "" for none."""
        o = dict(self.options)
        parts = ([f"EPLB+{o['redundant_experts']}" if o.get("redundant_experts") else "EPLB"] if o.get("eplb") else [])
        return ", ".join(parts + (["TBO"] if o.get("two_batch_overlap") else []))

    @property
    def shown(self) -> str:
        """The name with the MoE options chosen for it: "DP16EP16 (EPLB+16, TBO)"."""
        return f"{self.name} ({self.moe})" if self.moe else self.name

    @property
    def fits(self) -> bool:
        return self.memory.fits

    def to_dict(self) -> dict:
        gib = 2**30
        m = self.memory
        return {
            "layout": str(self.layout), "replicas": self.replicas, "name": self.name, "gpus": self.gpus,
            "moe_options": dict(self.options),
            "concurrency": self.concurrency, "fits": self.fits,
            "memory_gib": {"used": m.used / gib, "capacity": m.capacity / gib, "weights": m.weights / gib,
                           "kv_cache": m.kv_cache / gib, "activations": m.activations / gib,
                           "buffers": m.buffers / gib, "reserve": m.reserve / gib,
                           "shortfall": m.shortfall / gib},
            "ttft_ms": self.ttft_s * 1e3, "tpot_ms": self.tpot_s * 1e3,
            "arrival_rate_per_s": self.arrival_rate, "prefill_load": self.prefill_load,
            "sustainable": self.sustainable, "overload": self.overload,
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
                         "kv_dtype": w.kv_dtype, "request_rate": w.request_rate},
            "recommended": self.recommended.name if self.recommended else None,
            "reasons": list(self.reasons), "evaluated": self.evaluated,
            "placement": self.placement.to_dict() if self.placement else None,
            "predictions": [p.to_dict() for p in self.predictions],
        }
