"""One MoE layer's cost: expert imbalance, EP against expert TP (moe_tp), and the island-first
exchange across nodes, each against a published figure or traffic a reader can count."""

import pytest

from atoll.errors import ConfigError
from atoll.models.presets import resolve_model
from atoll.parallel.layout import Layout
from atoll.parallel.placement import Placement
from atoll.planner import Workload
from atoll.planner.categories import COMPUTE, EXPERTS
from atoll.planner.cost import CostModel
from atoll.planner.efficiency import link_efficiency
from atoll.planner.moe_cost import (EXPERT_IMBALANCE, busiest_pairs, expected_busiest_experts,
                                    expert_imbalance)
from atoll.planner.points import decode_point, prefill_point
from atoll.planner.shapes import shapes
from atoll.topologies import load_topology

DSV3 = shapes(resolve_model("DeepSeek-V3")[1])  # 256 routed experts, top-8, hidden 7168, 58 MoE layers
UNIFORM = Workload(expert_imbalance=1.0)


def stage(layout, topo, imbalance, **kw):
    """Seconds by category of one pass through the first pipeline stage (all 58 MoE layers
    but TP8PP2's)."""
    name, config = resolve_model("DeepSeek-V3")
    w = Workload(expert_imbalance=imbalance).resolved(config)
    lay = Layout.parse(layout)
    cm = CostModel(config, shapes(config), topo, w, lay, Placement.build(lay, topo, allow_cross_island=True))
    return cm.stage(0, **kw)


def experts_time(parts):
    """The expert GEMMs' time: read-bound or compute-bound (attention's compute is the same in
    the layouts compared, and does not move with the imbalance)."""
    return parts.get(EXPERTS, 0.0) + parts.get(COMPUTE, 0.0)


def test_default_is_the_published_no_eplb_figure():
    # TensorRT-LLM tech blog 4, Table 1: DeepSeek-R1, EP32 on 32 GB200 (8 experts per rank), no
    # EPLB: the hottest rank gets (max - mean) / mean = 1.564 more routed tokens than the mean
    assert EXPERT_IMBALANCE == pytest.approx(1 + 1.564, abs=0.005)
    # the gate model fitted to it (planner/expert_balance.py) gives it back at EP32 ...
    assert expert_imbalance(Workload(), DSV3, 32) == pytest.approx(2.564, rel=0.03)
    # ... and less over more experts a rank: EP16 holds 16 (between the excess halved and the
    # excess over the square root of two, as the hottest expert is shared by more others)
    assert 1 + 1.564 / 2 - 0.05 < expert_imbalance(Workload(), DSV3, 16) < 1 + 1.564 / 2 ** 0.5
    # EP2: a rank cannot get more than every token's pairs, 2x the mean
    assert expert_imbalance(Workload(), DSV3, 2) <= 2.0
    # a figure the user gives is taken as it is; ep == 1 (every rank a slice of every expert)
    # has no imbalance across ranks
    assert expert_imbalance(Workload(expert_imbalance=1.3), DSV3, 16) == 1.3
    assert expert_imbalance(Workload(expert_imbalance=3.0), DSV3, 1) == 1.0


def test_imbalance_one_reproduces_uniform_routing():
    # many tokens, experts evenly over 16 ranks: each rank gets k/ep of the pairs, 8/16
    pairs, distinct = busiest_pairs(UNIFORM, DSV3, 100_000, 16)
    assert pairs == pytest.approx(100_000 * 8 / 16) and distinct == pytest.approx(16)
    # one token: the busiest rank runs its distinct experts once each, the uniform draw
    pairs, distinct = busiest_pairs(UNIFORM, DSV3, 1, 16)
    assert pairs == pytest.approx(distinct) == pytest.approx(expected_busiest_experts(1, 256, 8, 16))
    # the default adds the measured skew at large batches (GEMM rows of the busiest rank) ...
    skewed, _ = busiest_pairs(Workload(), DSV3, 100_000, 16)
    assert skewed / (100_000 * 8 / 16) == pytest.approx(expert_imbalance(Workload(), DSV3, 16))
    # ... but not on top of the draw at batch 1, which is already 3x the mean of 0.5 pairs
    assert busiest_pairs(Workload(), DSV3, 1, 16)[0] == pytest.approx(busiest_pairs(UNIFORM, DSV3, 1, 16)[0])


def test_default_imbalance_raises_ep_expert_time_not_moe_tp():
    # SGLang's large-scale EP blog (DeepSeek-V3, 96 H100): EPLB sped decode up 2.54x and prefill
    # 1.49x, so imbalance costs time in both. At SGLang's decode batch (256 sequences a GPU) and
    # prefill length (4096) the busiest rank's GEMMs bind on FLOPs, which the skew multiplies;
    # moe_tp splits every expert over every rank: nothing to balance.
    topo = load_topology("dgx-h200", nodes=2)
    decode = dict(new_tokens=1, ctx=1152, prefill=False)
    prefill = dict(new_tokens=4096, ctx=4096, prefill=True)
    for kw in (decode, prefill):
        seqs = 256 if kw is decode else 1
        ep = [stage("DP16EP16", topo, imb, seqs_per_dp=seqs, active_dp=16, **kw) for imb in (None, 1.0)]
        assert experts_time(ep[0]) > experts_time(ep[1])
        assert ep[0]["all-to-all over infiniband"] > ep[1]["all-to-all over infiniband"]
        for name in ("TP8PP2", "TP16"):  # tp = 8 or 16, dp = 1: one DP rank holds all 16 x seqs
            tp = [stage(name, topo, imb, seqs_per_dp=16 * seqs, active_dp=1, **kw) for imb in (None, 1.0, 3.0)]
            assert tp[0] == tp[1] == tp[2]


def test_ep_and_moe_tp_differ_by_their_traffic():
    # DP attention on one 8-GPU node, n = 256 tokens a rank, every rank busy. EP8 (whole
    # experts) sends each token's k = 8 pairs out, fp8, and gets 8 bf16 results back: per rank
    # n x 8 x 7/8 x h x (1 + 2) = 21 n h bytes. moe_tp 8 (every expert split 8 ways) gathers
    # all 8n tokens of the stage to every rank, 7/8 x 8n x 2h = 14 n h, and all-reduces the
    # partial sums of all of them, twice that: 42 n h. EP moves half the bytes.
    topo = load_topology("dgx-h200")
    kw = dict(seqs_per_dp=256, active_dp=8, new_tokens=1, ctx=1152, prefill=False)
    ep, tp = stage("DP8EP8", topo, 1.0, **kw), stage("DP8", topo, 1.0, **kw)
    ep_x = ep["all-to-all over nvlink"]
    tp_x = tp["MoE all-gather over nvlink"] + tp["MoE all-reduce over nvlink"]
    assert 0.4 < ep_x / tp_x < 0.6
    # with routing balanced, both run every pair once on the same weights: the same GEMM time
    assert experts_time(ep) == pytest.approx(experts_time(tp))
    # skewed routing (the default) loads EP's busiest rank: it receives more (here its GEMMs
    # still wait on the weight reads, 89 rows an expert); moe_tp's ranks stay even
    assert stage("DP8EP8", topo, None, **kw)["all-to-all over nvlink"] > ep_x
    assert stage("DP8", topo, None, **kw) == tp


def test_ep_prefill_across_two_nodes_charges_only_copies_that_leave_the_node():
    # DP16EP16 on 2 x 8 H200, one 1024-token prompt on one rank. Island first (DeepEP's
    # internode path, the runtime's Dispatcher): a token crosses once if any of its 8 experts is
    # on the other node, 1 - (1/2)^8 of the time, as fp8 (7168 bytes) with its 8 ids and
    # weights (64 bytes), and one bf16 partial sum (14336 bytes) comes back, over the rank's own
    # 400 Gb/s NIC at DeepEP's measured 43 of 50 GB/s. Charging every pair that leaves the node
    # instead (8 x 8/16 = 4 copies a token) is the 4x overcharge this replaces.
    nic = 50e9 * link_efficiency("infiniband")
    crossing = 1024 * (1 - 0.5**8) * ((7168 + 64) + 7168 * 2) / nic  # seconds per MoE layer
    old = 1024 * 8 * 8 / 16 * (7168 + 7168 * 2) / nic

    def per_layer(gbit):
        topo = load_topology("dgx-h200", nodes=2, network=f"infiniband:{gbit}")
        parts = stage("DP16EP16", topo, 1.0, seqs_per_dp=1, active_dp=1, new_tokens=1024, ctx=1024, prefill=True)
        return parts["all-to-all over infiniband"] / 58

    # what the network's bandwidth costs: doubling it saves half of the crossing time
    assert 2 * (per_layer(400) - per_layer(800)) == pytest.approx(crossing, rel=0.01)
    assert per_layer(400) < old / 2  # the NVLink leg and message latencies stay small beside it


def test_low_latency_decode_sends_every_pair_over_rdma():
    """DeepEP's low-latency decode (Workload.low_latency_decode) sends each (token, expert) pair
    over RDMA: at EP72 over nine nodes a decode step's exchange costs more than the island-first
    one, which crosses once per remote node a token reaches; a prefill pass is unchanged."""
    topo = load_topology("dgx-h100", nodes=9)
    ex = "all-to-all over infiniband"
    d = [decode_point("DeepSeek-V3", topo, "DP72EP72", batch_per_gpu=256, kv_len=2000,
                      workload=Workload(isl=1999, osl=1, low_latency_decode=on)) for on in (False, True)]
    assert d[1].breakdown[ex] > 1.2 * d[0].breakdown[ex]
    assert d[1].tokens_per_s_per_gpu < d[0].tokens_per_s_per_gpu
    p = [prefill_point("DeepSeek-V3", topo, "DP72EP72", isl=1024, tokens_per_gpu=4096,
                       workload=Workload(isl=1024, osl=1, low_latency_decode=on)) for on in (False, True)]
    assert p[0].step_s == p[1].step_s
    with pytest.raises(ConfigError, match="low_latency_decode"):
        Workload(low_latency_decode="yes")
