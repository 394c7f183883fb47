"""Steady serving in the planner (planner/serving.py): prompt chunks mixed into decode steps
(TPOT), queueing for the prefill (TTFT), the closed loop's fixed point, loads past saturation;
`atoll plan --check` keeping the burst's figures; the published figures these are checked
against are tests/data/published.yaml's dsr1-2xh100-c25-itl and -ttft (tests/planner/test_published.py)."""

import math

import pytest

from atoll.models.presets import resolve_model
from atoll.parallel.layout import Layout
from atoll.parallel.placement import Placement
from atoll.planner import Workload, plan_layouts
from atoll.planner.cost import CostModel, layer_kernels
from atoll.planner.serving import md1_wait, poisson_mean, steady_state
from atoll.planner.shapes import shapes
from atoll.topologies import load_topology


def one(model, topo, work, layout):
    return plan_layouts(model, topo, work, layouts=[layout]).predictions[0]


def cost_model(model, topo, work, layout):
    _, config = resolve_model(model)
    lay = Layout.parse(layout).validate(config)
    return CostModel(config, shapes(config), topo, work.resolved(config), lay,
                     Placement.build(lay, topo, allow_cross_island=True))


# --- the queue and the fixed points, against their formulas ---

def test_md1_wait_is_the_textbook_formula():
    assert md1_wait(0.5, 1.0) == pytest.approx(0.5)  # rho S / (2 (1 - rho)) = 0.5 / 1
    assert md1_wait(0.9, 1.0) == pytest.approx(0.9 / 0.2)
    assert md1_wait(0.0, 3.0) == 0.0
    assert md1_wait(1.0, 1.0) == math.inf and md1_wait(2.0, 1.0) == math.inf


def test_poisson_mean():
    assert poisson_mean(lambda k: k, 2.5, 1000) == pytest.approx(2.5)
    assert poisson_mean(lambda k: k * k, 2.5, 1000) == pytest.approx(2.5 + 2.5**2)  # Var + mean^2
    assert poisson_mean(lambda k: k, 2.5, 1) == pytest.approx(1 - math.exp(-2.5))  # capped at one


def test_open_loop_tpot_solves_its_fixed_point():
    # an affine step: D + a * prompt tokens; open loop at rate r brings r * T * isl prompt tokens a
    # step, so T = D + a * r * isl * T, T = D / (1 - a r isl)
    d, a, isl, r = 0.02, 2e-5, 1000, 10.0
    s = steady_state(lambda n, k, length: d + a * k * length, isl=isl, osl=200, concurrency=1000,
                     budget=10**6, rate=r)
    assert s.sustainable and s.tpot_s == pytest.approx(d / (1 - a * r * isl), rel=1e-6)
    full = d + a * s.chunk_tokens * (10**6 // isl)  # a full-budget step
    service = isl * full / (10**6 // isl * isl)
    assert s.load == pytest.approx(r * service)
    # TTFT: half a step + M/D/1 wait + its own step
    assert s.ttft_s == pytest.approx(s.tpot_s / 2 + md1_wait(r, service) + d + a * isl, rel=1e-6)


def test_closed_loop_fixed_point_little():
    topo = load_topology("dgx-h100", nodes=2)
    for conc, layout in ((25, "TP16"), (64, "TP8PP2"), (16, "2 x TP8"), (3, "2 x TP8")):
        p = one("DeepSeek-V3", topo, Workload(concurrency=conc), layout)
        e2e = p.ttft_s + 256 * p.tpot_s
        assert p.arrival_rate * e2e == pytest.approx(conc, rel=1e-6), layout  # lambda * E2E = C
        assert p.tokens_per_s_per_gpu == pytest.approx(p.arrival_rate * 256 / p.gpus)


# --- TPOT: prompt chunks beside decode ---

def test_mixed_step_costs_more_than_pure_decode():
    topo = load_topology("dgx-h100", nodes=2)
    cm = cost_model("DeepSeek-V3", topo, Workload(concurrency=25), "TP16")
    pure = cm.decode(25)[0]
    assert cm.decode(25, 1, 1024)[0] > pure
    assert cm.decode(25, 4, 1024)[0] > cm.decode(25, 1, 1024)[0]
    # the weights are read once per step: one step carrying both costs less than the two apart
    assert cm.decode(25, 1, 1024)[0] < pure + cm.decode(0, 1, 1024)[0]


def test_steady_tpot_grows_with_isl_over_osl():
    topo = load_topology("dgx-h100")
    over = []
    for osl in (2048, 512, 128):  # isl/osl = 1, 4, 16
        work = Workload(isl=2048, osl=osl, concurrency=32)
        pure = cost_model("Llama-3.1-70B", topo, work, "TP8").decode(32)[0]
        over.append(one("Llama-3.1-70B", topo, work, "TP8").tpot_s / pure)
    assert 1 < over[0] < over[1] < over[2]


def test_one_user_decodes_alone():
    # concurrency 1, closed loop: no other prompt arrives while the one request decodes
    topo = load_topology("dgx-h100", nodes=2)
    p = one("DeepSeek-V3", topo, Workload(concurrency=1), "TP16")
    pure = cost_model("DeepSeek-V3", topo, Workload(concurrency=1), "TP16").decode(1)[0]
    assert p.tpot_s == pytest.approx(pure)


def test_c25_tpot_carries_the_prompt_chunks():
    # dsr1-2xh100-c25-itl (ITL 38.8 ms measured): 25 clients, 1024 in, 256 out: about 25/256 of
    # a prompt arrives per step, and TPOT is the mean of the pure and the mixed steps
    topo = load_topology("dgx-h100", nodes=2)
    p = one("DeepSeek-V3", topo, Workload(concurrency=25), "TP16")
    cm = cost_model("DeepSeek-V3", topo, Workload(concurrency=25), "TP16")
    pure, mixed = cm.decode(25)[0], cm.decode(25, 1, 1024)[0]
    share = (p.tpot_s - pure) / (mixed - pure)  # chunks a step, as a mean
    assert 24 / 256 * 0.9 < share < 25 / 256 * 1.1


# --- TTFT: queueing ---

def test_ttft_grows_with_concurrency_and_rate():
    topo = load_topology("dgx-h100", nodes=2)
    ttft = [one("DeepSeek-V3", topo, Workload(concurrency=c), "TP16").ttft_s for c in (1, 25, 100, 400)]
    assert ttft == sorted(ttft) and ttft[-1] > 2 * ttft[0]
    opened = [one("DeepSeek-V3", topo, Workload(concurrency=400, request_rate=r), "TP16") for r in (1, 4, 8)]
    assert all(p.sustainable for p in opened)
    assert [p.ttft_s for p in opened] == sorted(p.ttft_s for p in opened)
    assert [p.prefill_load for p in opened] == sorted(p.prefill_load for p in opened)
    assert opened[0].arrival_rate == pytest.approx(1.0)  # open loop: the offered rate is served


def test_past_saturation_is_not_sustainable(capsys):
    from cli import run_cli as run

    topo = load_topology("dgx-h100", nodes=2)
    # prompts faster than the prefill can take them
    p = one("DeepSeek-V3", topo, Workload(concurrency=256, request_rate=500), "TP16")
    assert not p.sustainable and p.ttft_s == math.inf and "prefill load" in p.overload
    assert p.prefill_load >= 1 and "not sustainable" in p.reason
    # more requests decoding than the concurrency the cache was planned for
    q = one("DeepSeek-V3", topo, Workload(concurrency=8, request_rate=20), "TP16")
    assert not q.sustainable and "planned for" in q.overload
    assert q.arrival_rate < 20 and q.to_dict()["sustainable"] is False
    plan = plan_layouts("DeepSeek-V3", topo, Workload(concurrency=8, request_rate=20), layouts=["TP16", "TP8PP2"])
    assert plan.recommended is None and "no layout sustains 20 requests/s" in plan.reasons[0]
    code, out, err = run(capsys, "plan", "--model", "DeepSeek-V3", "--topology", "dgx-h100", "--nodes", "2",
                         "--concurrency", "8", "--request-rate", "20", "--layouts", "TP16")
    assert "overloaded" in out and "no layout sustains" in out + err and "Traceback" not in err


def test_open_loop_recommends_the_lowest_tpot():
    topo = load_topology("dgx-h200", nodes=2)
    plan = plan_layouts("DeepSeek-V3", topo, Workload(concurrency=64, request_rate=5),
                        layouts=["TP8PP2", "DP16EP16", "2 x TP8"])
    served = {round(p.tokens_per_s_per_gpu, 6) for p in plan.predictions}
    assert len(served) == 1  # every layout that sustains the rate serves it
    assert plan.recommended.tpot_s == min(p.tpot_s for p in plan.predictions)
    assert "sustain 5 requests/s" in plan.reasons[0]


# --- kernels counted in atoll's decode path ---

def test_kernel_floor_counts_the_decode_path():
    from atoll.planner import efficiency as eff

    _, v3 = resolve_model("DeepSeek-V3")
    _, llama = resolve_model("Llama-3.1-8B")
    assert layer_kernels(llama, dense=True) == 2 + 7 + 4
    assert layer_kernels(v3, dense=True) == 2 + 17 + 4
    assert layer_kernels(v3, dense=False) == 2 + 17 + 11 + 18 + 5  # MLA, experts, grouped router, shared
    topo = load_topology("dgx-h200")
    d = cost_model("DeepSeek-V3", topo, Workload(concurrency=1), "TP8").decode(1)[1]
    kernels = 3 * (2 + 17 + 4) + 58 * (2 + 17 + 11 + 18 + 5) + eff.KERNELS_PER_STEP
    assert d["kernel launch floors"] == pytest.approx(kernels * eff.KERNEL_OVERHEAD_S)
    assert {name for name, _, _ in eff.table()} >= {"kernels: MLA attention", "kernels: grouped router"}


# --- plan --check compares the burst it runs ---

def test_plan_check_predicts_the_burst_not_steady_serving(tmp_path):
    from atoll.calibrate.tiny import write_tiny
    from atoll.bench.plan_check import predict
    from atoll.models.config import ModelConfig

    d = write_tiny(tmp_path / "llama", layers=2)
    topo = load_topology("dgx-h100")
    pred = predict(str(d), topo, "TP2", batch=8, isl=32, osl=24)
    config = ModelConfig.load(d)
    lay = Layout.parse("TP2").validate(config)
    work = Workload(isl=32, osl=24, concurrency=8, dtype="fp32", kv_dtype="fp32").resolved(config)
    cm = CostModel(config, shapes(config), topo, work, lay, Placement.build(lay, topo, allow_cross_island=True),
                   ranks=2)
    assert pred["tpot_s"] == pytest.approx(cm.decode(8)[0])
    assert pred["ttft_s"] == pytest.approx(cm.prefill_burst(8))
    steady = plan_layouts(config, topo, work, layouts=["1 x TP2"]).predictions[0]
    assert steady.tpot_s > pred["tpot_s"]  # steady serving mixes prompt chunks in; the burst does not
