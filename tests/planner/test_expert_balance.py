"""The expert imbalance as a function of the placement (planner/expert_balance.py) and the MoE
options the search chooses (planner/moe_options.py)."""

import json

import numpy as np
import pytest

from atoll.errors import ConfigError
from atoll.models.presets import resolve_model
from atoll.planner import Workload, plan_layouts
from atoll.planner import efficiency as eff
from atoll.planner import expert_balance as balance
from atoll.planner.moe_cost import expert_imbalance
from atoll.planner.shapes import shapes
from atoll.topologies import load_topology

DSV3 = shapes(resolve_model("deepseek-v3")[1])


def test_the_gate_model_reproduces_the_figures_it_was_fitted_to():
    """SKEW_SIGMA and DRIFT_SIGMA give TensorRT-LLM's 2.56 (no EPLB) and 1.11 (32 spare slots)
    at EP32, and the hottest expert near its by-expert 11.95: a figure the fit was not given."""
    assert balance.modelled(256, 8, 32, 0, False) == pytest.approx(eff.EXPERT_IMBALANCE, rel=0.03)
    assert balance.modelled(256, 8, 32, 32, True) == pytest.approx(eff.EXPERT_IMBALANCE_EPLB, rel=0.03)
    rng = np.random.default_rng(1)
    hottest = np.mean([(x := rng.lognormal(0, eff.SKEW_SIGMA, 256)).max() / x.mean() for _ in range(400)])
    assert 10.0 < hottest < 14.5


@pytest.mark.slow
def test_the_fit_finds_the_stored_constants():
    skew, drift = balance.fit(eff.EXPERT_IMBALANCE, eff.EXPERT_IMBALANCE_EPLB)
    assert skew == pytest.approx(eff.SKEW_SIGMA, abs=0.03) and drift == pytest.approx(eff.DRIFT_SIGMA, abs=0.03)


def test_more_ranks_more_imbalance_and_spare_slots_bring_it_down():
    plain = [expert_imbalance(Workload(), DSV3, ep) for ep in (2, 8, 16, 32)]
    assert plain == sorted(plain) and plain[0] > 1.0
    w = Workload()
    assert expert_imbalance(w, DSV3, 1) == 1.0
    eplb = [expert_imbalance(Workload(eplb=True, redundant_experts=r), DSV3, 16) for r in (0, 16, 32)]
    assert eplb[0] < plain[2]  # placing by load alone helps
    assert eplb[2] < eplb[0] and eplb[1] < eplb[0]  # and copies more (noise aside, two a rank ~ one a rank)
    assert eplb[2] < 1.15
    # a given figure is the layout's, whatever the placement
    assert expert_imbalance(Workload(expert_imbalance=1.3), DSV3, 16) == 1.3


def test_recorded_loads_are_placed_as_the_runtime_places_them(tmp_path):
    """One hot expert a layer: contiguous blocks put it on one rank; EPLB with a copy a rank
    spreads it; the figure is the placement's, computed from the file."""
    loads = [[100] + [10] * 15, [10] * 8 + [100] + [10] * 7]
    f = tmp_path / "load.json"
    f.write_text(json.dumps({"layers": {str(i): {"experts": l, "tokens": [], "max_mean": 0} for i, l in enumerate(loads)}}))
    read = balance.read_loads(f)
    assert read == tuple(tuple(l) for l in loads)
    # 16 experts over 4 ranks: the hot rank holds 100 + 30 of the 250 a layer: 130 / 62.5
    assert balance.from_loads(read, 4, 0, False) == pytest.approx(130 / 62.5)
    assert balance.from_loads(read, 4, 4, True) < 1.2
    small = shapes(resolve_model("deepseek-v3")[1])
    with pytest.raises(ConfigError, match="counts 16 experts a layer; the model has 256"):
        expert_imbalance(Workload(eplb=True, expert_loads=read), small, 8)


def test_bad_load_files_and_options_are_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not an expert load file"):
        balance.read_loads(bad)
    with pytest.raises(ConfigError, match="cannot read it"):
        balance.read_loads(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="needs eplb"):
        Workload(redundant_experts=8)
    with pytest.raises(ConfigError, match="redundant_experts=-1"):
        Workload(eplb=True, redundant_experts=-1)


def test_the_search_chooses_eplb_and_tbo_and_says_why():
    topo = load_topology("dgx-h200", nodes=2)
    w = Workload(isl=1024, osl=256, concurrency=1024)
    auto = plan_layouts("deepseek-v3", topo, w, layouts=["DP16EP16"], eplb="auto", tbo="auto")
    off = plan_layouts("deepseek-v3", topo, w, layouts=["DP16EP16"])  # as the workload has them: off
    a, o = auto.predictions[0], off.predictions[0]
    assert o.moe == "" and a.moe  # the options it chose are in the name
    assert a.tokens_per_s_per_gpu > o.tokens_per_s_per_gpu
    assert dict(a.options)["eplb"] and dict(a.options)["redundant_experts"] in (0, 16, 32)
    assert any("EPLB" in r and "the mean" in r for r in auto.reasons)
    # a dense model has no options to choose
    dense = plan_layouts("llama-3.1-8b", load_topology("dgx-h200"), Workload(concurrency=8), layouts=["TP2"],
                         eplb="auto", tbo="auto")
    assert dense.predictions[0].moe == ""
