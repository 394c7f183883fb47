"""Each metric of tests/data/published.yaml as the planner predicts it (examples/planner_vs_published.py):
the entry's model, cluster and operating point in, (predicted value, the band the planner states,
the precision it costed) out."""

from __future__ import annotations

import dataclasses

from atoll.models.config import ModelConfig
from atoll.models.presets import resolve_model
from atoll.planner import Workload, plan_layouts
from atoll.planner import efficiency as eff
from atoll.planner.disagg import disaggregated_gain
from atoll.planner.moe_options import FIXED
from atoll.planner.points import decode_point, prefill_point
from atoll.topologies import load_topology
from atoll.topologies.load import with_network

# the fields a model given as a dict takes from a Llama-architecture config (DistServe's 13B)
_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "head_dim": 128, "rms_norm_eps": 1e-5,
          "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float16"}

SERVING = ("tokens_per_s_per_user", "tokens_per_s_per_gpu", "tpot_ms", "ttft_ms", "ratio")
METRICS = SERVING + ("prefill_tokens_per_s_per_gpu", "decode_tokens_per_s_per_gpu", "disagg_gain", "eplb_gain")


def model_of(entry: dict):
    m = entry["model"]
    return ModelConfig.from_dict(_LLAMA | m) if isinstance(m, dict) else m


def model_name(entry: dict) -> str:
    return entry.get("model_name") or str(entry["model"])


def workload_of(entry: dict, model) -> Workload:
    """The entry's operating point; the engine features its source names (eplb, two-batch
    overlap, speculative decoding)."""
    engine = entry.get("engine") or {}
    w = Workload(isl=entry["isl"], osl=entry["osl"], concurrency=entry.get("concurrency", 1),
                 request_rate=entry.get("request_rate"), kv_dtype=entry.get("kv_dtype", "auto"),
                 eplb=bool(engine.get("eplb")), redundant_experts=int(engine.get("redundant_experts", 0)),
                 two_batch_overlap=bool(engine.get("two_batch_overlap")),
                 low_latency_decode=bool(engine.get("low_latency_decode")))
    config = model if isinstance(model, ModelConfig) else None
    if config is None:
        config = resolve_model(model)[1]
    w = w.resolved(config)
    spec = engine.get("speculative")
    if spec:
        w = dataclasses.replace(w, spec_tokens=spec["tokens"], spec_method=spec["method"],
                                acceptance=acceptance_of(config, w, spec))
    return w


def acceptance_of(config, w: Workload, spec: dict) -> float:
    """A drafted token's chance to be kept: given, or solved so that the planner's speedup of
    speculation over none, at the operating point where the source measured one
    (`speedup_measured`: topology, nodes, layout, speedup), equals the measured one. Acceptance
    is the model's and the text's, not the hardware's: measured on one machine, it carries to
    another."""
    if "acceptance" in spec:
        return float(spec["acceptance"])
    m = spec["speedup_measured"]
    topo = load_topology(m["topology"], nodes=m.get("nodes", 1))

    def speedup(a: float) -> float:
        on = dataclasses.replace(w, spec_tokens=spec["tokens"], spec_method=spec["method"], acceptance=a)
        fast, slow = (plan_layouts(config, topo, x, layouts=[m["layout"]], eplb=FIXED, tbo=FIXED)
                      .predictions[0].tokens_per_s_per_user
                      for x in (on, w))
        return fast / slow

    lo, hi = 0.0, 1.0  # the speedup grows with the acceptance
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if speedup(mid) < m["speedup"] else (lo, mid)
    return (lo + hi) / 2


def topology_of(entry: dict):
    topo = load_topology(entry["topology"], nodes=entry["nodes"])
    return with_network(topo, entry["network"]) if entry.get("network") else topo


def predict(entry: dict) -> tuple[float, float, str]:
    """(predicted, band, weights/KV precision) for the entry's metric."""
    metric = entry["metric"]
    model, topo = model_of(entry), topology_of(entry)
    work = workload_of(entry, model)
    dtype = f"{work.dtype}/{work.kv_dtype}"
    band = eff.PREDICTION_BAND_TPOT
    layout = entry["layouts"][0]
    if metric == "eplb_gain":  # the same pass with the entry's EPLB over without (its redundant slots kept static)
        off = dataclasses.replace(work, eplb=False, redundant_experts=0)
        on, without = (_pass_rate(entry, model, topo, layout, w) for w in (work, off))
        return on / without, band, dtype
    if metric == "prefill_tokens_per_s_per_gpu":
        p = prefill_point(model, topo, layout, isl=entry["isl"], tokens_per_gpu=entry["tokens_per_gpu"], workload=work)
        return p.tokens_per_s_per_gpu, band, dtype
    if metric == "decode_tokens_per_s_per_gpu":
        w = dataclasses.replace(work, isl=max(1, entry["kv_len"] - 1), osl=1)
        p = decode_point(model, topo, layout, batch_per_gpu=entry["batch_per_gpu"], kv_len=entry["kv_len"], workload=w)
        return p.tokens_per_s_per_gpu, band, dtype
    if metric == "disagg_gain":
        d, slo = entry["disagg"], entry["slo"]
        g = disaggregated_gain(model, topo, work, colocated=layout, prefill=d["prefill"], decode=d["decode"],
                               x=d["x"], y=d["y"], ttft_s=slo["ttft_ms"] / 1e3, tpot_s=slo["tpot_ms"] / 1e3)
        return g, band, dtype
    if metric not in SERVING:
        raise ValueError(f"{entry['id']}: unknown metric {metric!r}")
    plan = plan_layouts(model, topo, work, layouts=list(entry["layouts"]), eplb=FIXED, tbo=FIXED)
    by_name = {p.name: p for p in plan.predictions} | {str(p.layout): p for p in plan.predictions}
    p = by_name[_name(layout)]
    if metric == "tokens_per_s_per_user":
        return p.tokens_per_s_per_user, p.band, dtype
    if metric == "tokens_per_s_per_gpu":
        return p.tokens_per_s_per_gpu, p.band, dtype
    if metric == "tpot_ms":
        return p.tpot_s * 1e3, p.band, dtype
    if metric == "ttft_ms":
        return p.ttft_s * 1e3, p.ttft_band, dtype
    q = by_name[_name(entry["layouts"][1])]  # ratio: tokens/s/GPU of layouts[0] over layouts[1]
    return p.tokens_per_s_per_gpu / q.tokens_per_s_per_gpu, p.band, dtype


def _pass_rate(entry: dict, model, topo, layout: str, work: Workload) -> float:
    """Tokens/s/GPU of the entry's prefill pass (tokens_per_gpu) or decode step (batch_per_gpu)."""
    if "tokens_per_gpu" in entry:
        return prefill_point(model, topo, layout, isl=entry["isl"], tokens_per_gpu=entry["tokens_per_gpu"],
                             workload=work).tokens_per_s_per_gpu
    w = dataclasses.replace(work, isl=max(1, entry["kv_len"] - 1), osl=1)
    return decode_point(model, topo, layout, batch_per_gpu=entry["batch_per_gpu"], kv_len=entry["kv_len"],
                        workload=w).tokens_per_s_per_gpu


def _name(text: str) -> str:
    """'1 x TP4' -> 'TP4' (a single replica is named by its layout alone)."""
    parts = [t.strip() for t in str(text).split("x", 1)] if " x " in str(text) else [str(text)]
    return parts[-1] if len(parts) == 2 and parts[0] == "1" else str(text)
