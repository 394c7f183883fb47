"""The planner's trade-offs, memory fit and search bound, each against numbers a reader can
check (published parameter counts, data-sheet memory), never against the program's output."""

import math

import pytest

from atoll.models.presets import PRESETS, resolve_model
from atoll.parallel.layout import Layout
from atoll.planner import Workload, plan_layouts
from atoll.planner.moe_cost import expected_busiest_experts
from atoll.planner.memory import memory_fit
from atoll.planner.shapes import shapes
from atoll.topologies import load_topology

GIB = 2**30


def by_name(plan):
    return {p.name: p for p in plan.predictions}


# published totals (model cards / papers), in billions of parameters
@pytest.mark.parametrize("name, billions, active", [
    ("Llama-3.1-8B", 8.03, None), ("Llama-3.1-70B", 70.6, None), ("Llama-3.1-405B", 405.9, None),
    ("Mixtral-8x7B", 46.7, 12.9), ("Mixtral-8x22B", 141, 39), ("Qwen3-30B-A3B", 30.5, 3.3),
    ("Qwen3-235B-A22B", 235, 22), ("DeepSeek-V3", 671, 37),
])
def test_presets_match_published_parameter_counts(name, billions, active):
    s = shapes(resolve_model(name)[1])
    assert s.total_params / 1e9 == pytest.approx(billions, rel=0.01)
    if active:
        assert s.active_params / 1e9 == pytest.approx(active, rel=0.03)


def test_kv_cache_per_token_matches_reference_arithmetic():
    # Llama-3.1-405B: 126 layers x 8 KV heads x 128 x 2 (K,V) x 2 bytes = 516,096 B (~504 KiB)
    s = shapes(resolve_model("Llama-3.1-405B")[1])
    assert s.kv_bytes_per_token_layer(1, 2) * s.layers == 126 * 8 * 128 * 2 * 2
    # DeepSeek-V3 MLA: (512 + 64) x 61 layers x 2 bytes, and TP does not shrink the latent
    d = shapes(resolve_model("DeepSeek-V3")[1])
    assert d.kv_bytes_per_token_layer(8, 2) * d.layers == (512 + 64) * 61 * 2
    assert set(PRESETS) >= {"Llama-3.1-8B", "Mixtral-8x22B", "Qwen3-30B-A3B"}


def test_expected_busiest_experts():
    # one token, 256 experts one per rank: 8 ranks work, the busiest runs 1 (the model treats
    # experts as independent draws, so it gives 1 - (1 - 8/256)^256 = 0.9997)
    assert expected_busiest_experts(1, 256, 8, 256) == pytest.approx(1 - (1 - 8 / 256) ** 256)
    # a single rank runs the expected number of distinct experts: E * (1 - (1 - k/E)^t)
    assert expected_busiest_experts(3, 256, 8, 1) == pytest.approx(256 * (1 - (1 - 8 / 256) ** 3))
    # many tokens touch every expert
    assert expected_busiest_experts(100000, 256, 8, 16) == pytest.approx(16)
    # the busiest of 16 ranks runs more than the mean (8 experts / 16 ranks = 0.5)
    assert expected_busiest_experts(1, 256, 8, 16) > 1.5


DSV3 = ["TP8PP2", "EP16", "DP16EP16"]  # EP16 parses as TP16EP16; DP16EP16 is DP attention + EP


def test_deepseek_concurrency_one_prefers_tp8pp2_latency():
    topo = load_topology("dgx-h200", nodes=2)
    p = by_name(plan_layouts("DeepSeek-V3", topo, Workload(concurrency=1, dtype="fp8"), layouts=DSV3))
    assert p["TP8PP2"].tpot_s < p["TP16EP16"].tpot_s
    assert p["TP8PP2"].tpot_s < p["DP16EP16"].tpot_s
    assert "over infiniband" in p["DP16EP16"].reason  # EP16 pays IB messages every MoE layer


def test_deepseek_high_concurrency_prefers_ep16_throughput():
    topo = load_topology("dgx-h200", nodes=2)
    plan = plan_layouts("DeepSeek-V3", topo, Workload(concurrency=1024, dtype="fp8"), layouts=DSV3)
    p = by_name(plan)
    assert p["DP16EP16"].tokens_per_s_per_gpu > p["TP8PP2"].tokens_per_s_per_gpu
    assert plan.recommended.name == "DP16EP16"
    # why: TP8 keeps the whole MLA latent on every TP rank, DP attention splits it 16 ways
    assert p["TP8PP2"].decode["HBM reads of KV cache"] > 4 * p["DP16EP16"].decode["HBM reads of KV cache"]


def test_deepseek_sweep_recommendation_changes_from_tp_to_dp_attention():
    topo = load_topology("dgx-h200", nodes=2)
    low = plan_layouts("DeepSeek-V3", topo, Workload(concurrency=1, dtype="fp8")).recommended
    high = plan_layouts("DeepSeek-V3", topo, Workload(concurrency=1024, dtype="fp8")).recommended
    assert low.layout.dp == 1 and low.layout.tp == 8  # latency: TP inside the NVLink island
    assert high.layout.dp > 1  # throughput: attention data parallel, the MLA cache split


@pytest.mark.parametrize("concurrency", [64, 256])
def test_llama405b_tp8pp2_and_tp16_close_on_infiniband(concurrency):
    topo = load_topology("dgx-h100", nodes=2)
    p = by_name(plan_layouts("Llama-3.1-405B", topo, Workload(concurrency=concurrency),
                             layouts=["TP8PP2", "TP16"]))
    a, b = p["TP8PP2"].tokens_per_s_per_gpu, p["TP16"].tokens_per_s_per_gpu
    assert max(a, b) / min(a, b) < 1.5


@pytest.mark.parametrize("concurrency", [64, 256])
def test_llama405b_tp8pp2_several_times_faster_over_25g_ethernet(concurrency):
    topo = load_topology("dgx-h100", nodes=2, network="ethernet:25")
    p = by_name(plan_layouts("Llama-3.1-405B", topo, Workload(concurrency=concurrency),
                             layouts=["TP8PP2", "TP16"]))
    assert p["TP8PP2"].tokens_per_s_per_gpu > 3 * p["TP16"].tokens_per_s_per_gpu
    assert "ethernet" in p["TP16"].reason


def test_deepseek_fp8_does_not_fit_four_h200():
    # 671e9 params x 1 byte / 4 GPUs = 156 GiB of weights per GPU > 140.4 GiB (143771 MiB)
    topo = load_topology("dgx-h200", gpus_per_node=4)
    plan = plan_layouts("DeepSeek-V3", topo, Workload(concurrency=1, dtype="fp8"))
    assert plan.recommended is None and "no layout fits" in plan.reasons[0]
    assert all(not p.fits for p in plan.predictions)
    assert min(p.memory.weights for p in plan.predictions) > 671e9 / 4 * 0.99


def test_llama70b_bf16_fits_tp2_not_tp1_on_h200():
    name, config = resolve_model("Llama-3.1-70B")
    s, topo = shapes(config), load_topology("dgx-h200")
    w = Workload(isl=1024, osl=256, concurrency=32).resolved(config)  # bf16, the checkpoint's
    tp1 = memory_fit(config, s, topo, w, Layout(tp=1), batch=32)
    tp2 = memory_fit(config, s, topo, w, Layout(tp=2), batch=32)
    # 70.55e9 x 2 B = 131.4 GiB of weights; + 32 x 1280 tokens x 320 KiB = 12.5 GiB of KV
    assert tp1.weights / GIB == pytest.approx(70.55e9 * 2 / GIB, rel=0.01)
    assert tp1.kv_cache / GIB == pytest.approx(32 * 1280 * 80 * 8 * 128 * 2 * 2 / GIB, rel=1e-6)
    assert not tp1.fits and tp1.shortfall > 0
    assert tp2.fits and tp2.weights == pytest.approx(tp1.weights / 2, rel=0.01)
    plan = plan_layouts("Llama-3.1-70B", topo, Workload(concurrency=256))  # 8 x TP1 -> 32 each
    assert not by_name(plan)["8 x TP1"].fits and by_name(plan)["4 x TP2"].fits


def test_search_bound_on_128_gpus():
    # 128 = 2^7 GPUs: world sizes are 8 powers of two, tp <= 8 inside a node, pp | world, and
    # ep | tp*dp: at most 8 * 36 factorisations * 8 EP choices; pruning keeps it far lower
    topo = load_topology("dgx-h200", nodes=16)
    plan = plan_layouts("DeepSeek-V3", topo, Workload(concurrency=256, dtype="fp8"))
    assert plan.evaluated <= 8 * 36 * 8
    assert plan.evaluated <= 600
    assert all(p.layout.tp <= 8 for p in plan.predictions)
    dense = plan_layouts("Llama-3.1-405B", topo, Workload(concurrency=256))
    assert dense.evaluated <= 40 and all(p.layout.dp == 1 and p.layout.ep == 1 for p in dense.predictions)


def test_slos_filter_and_explain():
    topo = load_topology("dgx-h200", nodes=2)
    w = Workload(concurrency=64, dtype="fp8")
    none = plan_layouts("DeepSeek-V3", topo, w, tpot_ms=0.01)
    assert none.recommended is None and "no layout meets TPOT <= 0.01 ms" in none.reasons[0]
    free = plan_layouts("DeepSeek-V3", topo, w)
    # in a closed loop at one concurrency the throughput pick is the lowest TPOT too (tokens/s/GPU
    # = C x osl / (GPUs x end-to-end)), but not the quickest to a first token
    quickest = min(p.ttft_s for p in free.predictions if p.fits) * 1e3
    assert quickest < free.recommended.ttft_s * 1e3
    limit = (quickest + free.recommended.ttft_s * 1e3) / 2  # tighter than the unconstrained choice
    slo = plan_layouts("DeepSeek-V3", topo, w, ttft_ms=limit)
    assert slo.recommended is not None and slo.recommended.ttft_s * 1e3 <= limit
    assert slo.recommended.name != free.recommended.name


def test_replicas_versus_pipeline_and_placement():
    topo = load_topology("dgx-h200", nodes=2)
    plan = plan_layouts("DeepSeek-V3", topo, Workload(concurrency=1, dtype="fp8"), layouts=["TP8PP2", "2 x TP8"])
    p = by_name(plan)
    assert p["2 x TP8"].gpus == p["TP8PP2"].gpus == 16
    # one user: a second replica idles, a second stage adds one hand-off; neither is faster
    assert math.isclose(p["2 x TP8"].tpot_s, p["TP8PP2"].tpot_s, rel_tol=0.05)
    assert plan.recommended.replicas == 2 or plan.placement.node_of(15) == 1
