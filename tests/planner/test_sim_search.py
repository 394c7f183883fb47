"""The SLO search (planner/sim/search.py): the analytic model prunes, the simulator ranks."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import yaml

from atoll.errors import ConfigError
from atoll.models.presets import resolve_model
from atoll.planner.planfile import load_plan
from atoll.planner.sim.api import prepare
from atoll.planner.sim.candidates import splits
from atoll.planner.sim.deploy import Deployment
from atoll.planner.sim.judge import Judge, Target, scaled
from atoll.planner.sim.load import random_requests
from atoll.planner.sim.search import search
from atoll.topologies import load_topology

MODEL = "Llama-3.1-8B"
ISL, OSL = 1024, 96
SLOS = {"ttft": 1500.0, "tpot": 40.0}


@pytest.fixture(scope="module")
def setup():
    _, config = resolve_model(MODEL)
    topology = load_topology("dgx-h200")

    def make(n):
        return random_requests(n, input_len=ISL, output_len=OSL, vocab_size=config.vocab_size, seed=1, range_ratio=0.3)
    return config, topology, make


def _search(setup, target, **kw):
    config, topology, make = setup
    kw.setdefault("tune", False)
    return search(config, topology, make, target, base=Deployment(max_num_seqs=16), num_prompts=60, isl=ISL,
                  osl=OSL, model_name=MODEL, count=2, **kw)


@pytest.mark.slow
def test_highest_goodput_per_gpu_meets_its_slos_at_its_rate_and_not_far_above(setup):
    r = _search(setup, Target(SLOS))
    best = r.best
    assert best is not None and best.meets and best.gpus <= 8
    assert r.judged[0] is best
    assert all(best.goodput_per_gpu >= j.goodput_per_gpu for j in r.judged)
    assert r.reasons[0].startswith(best.deployment.describe())
    # judged again, unscaled and from scratch: it meets at the rate found, and misses well above it
    config, topology, make = setup
    reqs = make(1000)  # enough for a queue to grow past the TTFT SLO when overloaded
    p = prepare(config, topology, best.deployment, reqs, model_name=MODEL)
    at = p.run(reqs, rate=best.rate, slos=SLOS)["serve"]["goodput"]["attainment"]
    above = p.run(reqs, rate=best.rate * 2, slos=SLOS)["serve"]["goodput"]["attainment"]
    assert at >= 0.85 and above < at
    assert r.frontier and all(y > 0 for _, y, _ in r.frontier)


@pytest.mark.slow
def test_worker_processes_judge_as_one_process_does(setup):
    """The finalists judged on two forked workers give the same judgements, in the same order,
    as one process judging them in turn."""
    one = _search(setup, Target(SLOS), workers=1)
    two = _search(setup, Target(SLOS), workers=2)
    assert [(j.deployment, j.rate, j.meets, len(j.trials)) for j in one.judged] == \
        [(j.deployment, j.rate, j.meets, len(j.trials)) for j in two.judged]
    assert one.runs == two.runs and len(one.judged) >= 3


def test_a_request_rate_takes_the_fewest_gpus_that_meet_it(setup):
    r = _search(setup, Target(SLOS, rate=12.0), disagg=False)
    best = r.best
    assert best is not None and best.meets
    assert all(best.gpus <= j.gpus for j in r.judged if j.meets)
    if not best.deployment.disaggregated and best.deployment.replicas > 1:  # one replica fewer misses
        config, topology, make = setup
        fewer = replace(best.deployment, replicas=best.deployment.replicas - 1)
        reqs = make(200)
        out = prepare(config, topology, fewer, reqs, model_name=MODEL).run(reqs, rate=12.0, slos=SLOS)
        assert out["serve"]["goodput"]["attainment"] < 0.9


def test_slos_no_deployment_meets_name_the_closest(setup):
    r = _search(setup, Target({"tpot": 0.5}, rate=5.0), disagg=False)
    assert r.best is None
    assert r.reasons[0].startswith("no deployment meets") and "closest is" in r.reasons[0]


@pytest.mark.slow
def test_tuning_keeps_only_options_that_win(setup):
    plain = _search(setup, Target(SLOS), disagg=False)
    tuned = _search(setup, Target(SLOS), disagg=False, tune=True)
    assert tuned.best.goodput_per_gpu >= plain.best.goodput_per_gpu


def test_scaling_and_splits():
    d = Deployment(layout="TP1", replicas=8)
    assert scaled(d) == (replace(d, replicas=2), 4)
    assert scaled(replace(d, prefix_caching=True))[1] == 1  # the router's choice matters: every replica
    x = Deployment(prefill="TP1", decode="TP2", prefill_replicas=4, decode_replicas=2)
    assert scaled(x) == (replace(x, prefill_replicas=2, decode_replicas=1), 2)
    c = replace(x, decode_replicas=4, colocated_replicas=2)  # 4P4D, 2 of them colocated: as 2P2D with 1
    assert scaled(c) == (replace(c, prefill_replicas=2, decode_replicas=2, colocated_replicas=1), 2)
    assert scaled(replace(c, colocated_replicas=1))[1] == 1
    assert splits(1, 2, 8, fill=True, most=3) == [(2, 3), (4, 2), (6, 1)]  # no GPU idle
    assert splits(2, 2, 6, fill=False)[0] == (1, 1)


def test_cli_saves_the_deployment_and_refuses_bad_input(tmp_path):
    out = tmp_path / "plan.yaml"
    cmd = [sys.executable, "-m", "atoll", "plan", "--model", MODEL, "--topology", "dgx-h200", "--goodput",
           "ttft:1500", "tpot:40", "--isl", str(ISL), "--osl", str(OSL), "--request-rate", "6", "--max-num-seqs", "16",
           "--num-prompts", "60", "--finalists", "2", "--no-disagg", "--save", str(out), "--format", "json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    plan = load_plan(out)
    assert plan.deployment["max_num_seqs"] >= 1 and plan.predictions["attainment"] >= 0.9
    d = yaml.safe_load(out.read_text())
    d["deployment"]["router"] = "nearest"
    out.write_text(yaml.safe_dump(d))
    with pytest.raises(ConfigError, match="deployment: router 'nearest'"):
        load_plan(out)
    for bad, says in ((["--request-rate", "0"], "--request-rate 0"), (["--slo-attainment", "1.5"], "(0, 1]"),
                      (["--isl", "0"], "--isl 0"), (["--goodput", "ttft:-1"], "positive")):
        r = subprocess.run(cmd[:cmd.index("--save")] + bad, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_an_slo_nobody_meets_exits_1_with_one_line():
    cmd = [sys.executable, "-m", "atoll", "plan", "--model", MODEL, "--topology", "dgx-h200", "--goodput",
           "tpot:0.5", "--isl", "256", "--osl", "16", "--request-rate", "2", "--max-num-seqs", "8",
           "--num-prompts", "20", "--finalists", "1", "--no-disagg"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    assert r.stderr.strip().startswith("atoll: no deployment meets") and "closest is" in r.stderr
    assert "deployment" in r.stdout and "why:" in r.stdout  # the table and its reasons still print


def test_a_measured_correction_scales_the_figures_and_tightens_the_slos(setup):
    config, topology, make = setup
    d = Deployment(layout="TP1", max_num_seqs=16)
    plain = Judge(config, topology, make, Target(SLOS, rate=3.0), num_prompts=60, model_name=MODEL).judge(d)
    slow = Judge(config, topology, make, Target(SLOS, rate=3.0, correction={"ttft": 3.0, "itl": 3.0}),
                 num_prompts=60, model_name=MODEL).judge(d)
    a, b = plain.trials[0].serve, slow.trials[0].serve
    assert b["tpot_ms"]["p90"] == pytest.approx(3 * a["tpot_ms"]["p90"])
    assert b["ttft_ms"]["p50"] == pytest.approx(3 * a["ttft_ms"]["p50"])
    assert b["goodput"]["slos_ms"]["tpot"] == pytest.approx(SLOS["tpot"] / 3)  # judged against the SLO / 3
    assert slow.trials[0].attainment <= plain.trials[0].attainment


def test_a_saved_xpyd_deployment_carries_its_colocated_replicas_to_serve():
    from argparse import Namespace

    from atoll.cli.plan_deploy import apply_deployment

    d = Deployment(prefill="TP1", decode="TP1", decode_replicas=3, colocated_replicas=2, min_prompt_tokens=256)
    args = Namespace(layout=None)
    words = apply_deployment(args, vars(d))
    assert (args.decode_replicas, args.colocated_replicas, args.disagg_min_prompt_tokens) == (3, 2, 256)
    assert "--colocated-replicas 2" in words
    apply_deployment(args := Namespace(layout=None), vars(replace(d, colocated_replicas=0)))
    assert not hasattr(args, "colocated_replicas")
