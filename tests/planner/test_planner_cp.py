"""The planner's context parallelism (planner/context.py): cp layouts named and searched, the KV
each GPU holds, the ring's bytes against a hand calculation, and the 128k-token plan of
Llama-3.1-70B on 2 x 8 H200 with and without cp."""

import pytest

from atoll.errors import AtollError
from atoll.models.presets import resolve_model
from atoll.parallel.layout import Layout
from atoll.parallel.placement import Placement
from atoll.planner import Workload, plan_layouts
from atoll.planner.context import (CP_FROM_TOKENS, decode_bytes_per_token,
                                   partial_bytes_per_token, prefill_bytes_per_token, query_bytes_per_token)
from atoll.planner.cost import CostModel
from atoll.planner.memory import memory_fit
from atoll.planner.search import enumerate_layouts, parse_candidate
from atoll.planner.shapes import shapes
from atoll.topologies import load_topology

MODEL = "Llama-3.1-70B"
# a full 128k context: Llama-3.1's 131072 positions hold the prompt and its 256 output tokens
LONG = dict(isl=131072 - 256, osl=256)
CONCURRENCY = 1


@pytest.fixture(scope="module")
def llama():
    return resolve_model(MODEL)[1]


@pytest.fixture(scope="module")
def h200x2():
    return load_topology("dgx-h200", nodes=2)


@pytest.fixture(scope="module")
def plans(h200x2):
    """The long-prompt plan without cp (max_cp 1) and with the default search."""
    w = Workload(concurrency=CONCURRENCY, **LONG)
    return plan_layouts(MODEL, h200x2, w, max_cp=1), plan_layouts(MODEL, h200x2, w)


@pytest.mark.parametrize("text, tp, cp, pp", [("CP2", 1, 2, 1), ("TP2CP2", 2, 2, 1), ("CP2PP2", 1, 2, 2),
                                              ("TP4CP2PP2", 4, 2, 2), ("TP8CP2", 8, 2, 1)])
def test_cp_layouts_parse_and_print_back(text, tp, cp, pp):
    layout = Layout.parse(text)
    assert (layout.tp, layout.cp, layout.pp, layout.world_size) == (tp, cp, pp, tp * cp * pp)
    assert str(layout) == text and str(Layout.parse(str(layout))) == text
    assert parse_candidate(text, 16) == (layout, 16 // layout.world_size)


def test_cp_refused_in_one_line_beside_dp_or_twice():
    with pytest.raises(AtollError, match="does not combine with dp or ep"):
        Layout.parse("TP2DP2EP4CP2")
    with pytest.raises(AtollError, match="CP twice"):
        Layout.parse("CP2TP2CP2")


def test_a_cp_layout_is_the_runtimes_layout():
    lay = Layout.parse("TP4CP2PP2")
    assert (str(lay), lay.world_size, lay.stage_size, lay.cp) == ("TP4CP2PP2", 16, 8, 2)
    assert str(Layout.parse("CP2")) == "CP2" and Layout(tp=8).cp == 1
    with pytest.raises(AtollError, match="MLA"):
        lay.validate(resolve_model("DeepSeek-V3")[1])


def test_a_cp_group_is_tp_ranks_apart(llama, h200x2):
    # TP8CP2: ranks 0 and 8, one on each node; TP4CP2: ranks 0 and 4 of node0, over NVLink
    cm = cost_model(llama, h200x2, "TP8CP2", **LONG)
    assert (cm.g_cp.size, cm.g_cp.kind, cm.g_tp.kind) == (2, "infiniband", "nvlink")
    assert cost_model(llama, h200x2, "TP4CP2", **LONG).g_cp.kind == "nvlink"


def test_cp_searched_only_for_long_prompts_or_when_asked(llama, h200x2):
    base = enumerate_layouts(llama, h200x2)
    assert all(lay.cp == 1 for lay, _ in base)
    short = plan_layouts(MODEL, h200x2, Workload(isl=CP_FROM_TOKENS - 1, concurrency=8))
    assert short.evaluated == len(base) and all(p.layout.cp == 1 for p in short.predictions)
    asked = plan_layouts(MODEL, h200x2, Workload(concurrency=8), max_cp=2)
    assert any(p.layout.cp == 2 for p in asked.predictions)
    assert max(p.layout.cp for p in asked.predictions) == 2
    # the cp = 1 candidates come first, as before, and keep their predictions
    same = {p.name: p.tpot_s for p in short.predictions}
    again = plan_layouts(MODEL, h200x2, Workload(isl=CP_FROM_TOKENS - 1, concurrency=8), max_cp=2)
    assert {p.name: p.tpot_s for p in again.predictions if p.layout.cp == 1} == same


def test_kv_bytes_per_gpu_halve_at_cp2(llama, h200x2):
    w = Workload(concurrency=CONCURRENCY, **LONG).resolved(llama)
    s = shapes(llama)
    one = memory_fit(llama, s, h200x2, w, Layout(tp=8), 1)
    two = memory_fit(llama, s, h200x2, w, Layout.parse("TP8CP2"), 1)
    # 130816 + 256 tokens x 80 layers x 1 KV head of 128 (K and V, bf16) on each TP8 rank
    assert one.kv_cache == 131072 * 80 * 1 * 128 * 2 * 2
    assert two.kv_cache == one.kv_cache / 2 and two.weights == one.weights


def test_kv_halved_in_the_plans_own_breakdown(plans):
    _, with_cp = plans
    by = {p.name: p for p in with_cp.predictions}
    # one request on each: 2 x TP8 holds it on one replica, TP8CP2 on both of its cp ranks
    assert by["TP8CP2"].memory.kv_cache == by["2 x TP8"].memory.kv_cache / 2
    assert by["TP8CP2"].to_dict()["memory_gib"]["kv_cache"] == pytest.approx(
        by["2 x TP8"].to_dict()["memory_gib"]["kv_cache"] / 2)


def test_exchange_bytes_per_token_by_hand(llama):
    s = shapes(llama)
    # Llama-3.1-70B on TP8: 64 / 8 = 8 query heads a rank, head_dim 128
    assert query_bytes_per_token(s, 8, 2) == 8 * 128 * 2 == 2048  # bf16 queries
    assert partial_bytes_per_token(s, 8) == 8 * (128 + 1) * 4 == 4128  # float32 output row + log-sum-exp
    # prefill, per prompt token of the step and layer, from one rank: half the tokens' queries
    # are its own (sent to the other), half the partials it made are the other's
    assert prefill_bytes_per_token(s, 8, 2, 2) == (2048 + 4128) / 2 == 3088
    assert prefill_bytes_per_token(s, 8, 4, 2) == 3 / 4 * (2048 + 4128)
    assert decode_bytes_per_token(s, 8, 2) == 4128 and decode_bytes_per_token(s, 8, 4) == 3 * 4128
    assert prefill_bytes_per_token(s, 8, 1, 2) == 0 == decode_bytes_per_token(s, 8, 1)


def cost_model(llama, topo, layout_text, **work):
    layout = Layout.parse(layout_text)
    w = Workload(**work).resolved(llama)
    return CostModel(llama, shapes(llama), topo, w, layout, Placement.build(layout, topo))


def test_exchange_time_over_the_network_by_hand(llama, h200x2):
    """TP8CP2's cp pairs cross InfiniBand, one rank a node: each layer sends a rank's bytes
    (prefill_bytes_per_token x tokens) at the link's bandwidth, three message latencies (the
    query all-gather, the all-to-all's send and completion); the last stage gathers the hidden
    rows once (half of them cross)."""
    isl = 8192
    cm = cost_model(llama, h200x2, "TP8CP2", isl=isl, osl=64, concurrency=1)
    g = cm.g_cp
    assert (g.size, g.per_island, g.islands, g.kind) == (2, 1, 2, "infiniband")
    bw, lat = g.cross_bw, g.cross_lat
    want = 80 * (isl * 3088 / bw + 3 * lat) + (isl * 8192 * 2 / 2 / bw + lat)
    assert cm.prefill(1)[2]["CP exchange over infiniband"] == pytest.approx(want, rel=1e-12)
    # decode, 16 sequences and no chunk: one all-gather a layer of every rank's partials
    parts = cm.decode(16)[1]
    assert parts["CP exchange over infiniband"] == pytest.approx(80 * (16 * 4128 / bw + lat), rel=1e-12)
    # the prefill's GEMM rows and attention per rank are half of TP8's
    one = cost_model(llama, h200x2, "TP8", isl=isl, osl=64, concurrency=1).prefill(1)[2]
    two = cm.prefill(1)[2]
    assert two["compute"] == pytest.approx(one["compute"] / 2, rel=0.02)


def test_128k_plan_without_cp_states_its_reason(plans):
    without, _ = plans
    assert all(p.layout.cp == 1 for p in without.predictions)
    assert without.reasons
    if without.recommended is not None:
        assert without.recommended.fits and without.reasons[0].startswith(f"recommended {without.recommended.name}")


def test_128k_plan_with_cp_picks_a_cp_layout_that_fits(plans):
    without, with_cp = plans
    best = with_cp.recommended
    assert best is not None and best.layout.cp > 1 and best.fits
    why = [r for r in with_cp.reasons if r.startswith("context parallelism:")]
    assert len(why) == 1 and best.name in why[0]
    # cp halves the prefill's attention per rank: a shorter TTFT than every layout without it
    assert best.ttft_s < min(p.ttft_s for p in without.predictions if p.fits)


def test_cli_max_cp(capsys):
    from atoll.cli.main import main

    base = ["plan", "--model", MODEL, "--topology", "dgx-h200", "--nodes", "2", "--no-progress"]
    with pytest.raises(SystemExit) as e:
        main(base + ["--max-cp", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--max-cp 0" in err[0]
    with pytest.raises(SystemExit) as e:
        main(base + ["--isl", str(LONG["isl"]), "--concurrency", "1", "--layouts", "TP8CP2,2 x TP8", "--format", "json"])
    import json

    out = json.loads(capsys.readouterr().out)
    assert e.value.code == 0 and out["recommended"] == "TP8CP2"
    kv = {p["name"]: p["memory_gib"]["kv_cache"] for p in out["predictions"]}
    assert kv["TP8CP2"] == pytest.approx(kv["2 x TP8"] / 2)
