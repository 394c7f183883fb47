"""atoll simulate (planner/sim): the engine's own scheduler, pools, router and disaggregation
decision on the cost model's clock."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from atoll.errors import ConfigError
from atoll.planner.sim.api import Deployment, prepare, simulate
from atoll.planner.sim.clock import bucket
from atoll.planner.sim.deploy import engine_kind
from atoll.planner.sim.load import mixed_requests, random_requests, shared_prefix_requests
from atoll.planner.sim.run import INTAKE_S, Simulation
from atoll.planner.sim.stepfit import StepFit, fit
from atoll.topologies.calibration import Calibration
from atoll.models.presets import resolve_model
from atoll.topologies import load_topology

MODEL = "Llama-3.1-8B"


@pytest.fixture(scope="module")
def h200():
    return load_topology("dgx-h200")


def _reqs(n=120, isl=512, osl=64, **kw):
    return random_requests(n, input_len=isl, output_len=osl, vocab_size=32000, seed=3, **kw)


def test_every_request_completes_with_its_length_and_runs_repeat(h200):
    reqs = _reqs(range_ratio=0.5)
    a = simulate(MODEL, h200, Deployment(layout="TP2", replicas=2, max_num_seqs=16), reqs, rate=30.0)
    b = simulate(MODEL, h200, Deployment(layout="TP2", replicas=2, max_num_seqs=16), reqs, rate=30.0)
    s = a["serve"]
    assert (s["completed"], s["failed"]) == (len(reqs), 0)
    assert s["total_output_tokens"] == sum(r.output_len for r in reqs)
    assert s["total_input_tokens"] == sum(len(r.prompt) for r in reqs)
    assert a["serve"] == b["serve"]  # a simulation is a function of its inputs
    for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert 0 < s[m]["p50"] <= s[m]["p90"] <= s[m]["p99"]
    assert all(0 < e["busy_share"] <= 1 for e in a["engines"])


def test_a_lone_request_decodes_at_the_cost_models_step(h200):
    """One request at a time: each decode tick is the cost model's one-row pass at its context."""
    reqs = _reqs(n=3, isl=256, osl=33)
    out = simulate(MODEL, h200, Deployment(layout="TP1"), reqs, rate=0.01)
    _, config = resolve_model(MODEL)
    kind = engine_kind(config, h200, Deployment(layout="TP1"), "TP1", isl=256, osl=33)
    steps = [kind.cost_model.micro_batch(1, 0, ctx=c, chunk_ctx=0)[0] for c in range(257, 257 + 32)]
    assert out["serve"]["tpot_ms"]["p50"] == pytest.approx(sum(steps) / len(steps) * 1e3, rel=0.01)
    prefill = kind.cost_model.micro_batch(0, 256, ctx=0, chunk_ctx=128)[0]
    # the prefill, after the API server's intake
    assert out["serve"]["ttft_ms"]["p50"] == pytest.approx((INTAKE_S + prefill) * 1e3, rel=0.02)


def test_queueing_grows_with_the_rate(h200):
    reqs = _reqs(n=200, isl=1024, osl=64)
    low = simulate(MODEL, h200, Deployment(layout="TP1", max_num_seqs=64), reqs, rate=2.0)["serve"]
    high = simulate(MODEL, h200, Deployment(layout="TP1", max_num_seqs=64), reqs, rate=200.0)["serve"]
    assert high["ttft_ms"]["p90"] > 3 * low["ttft_ms"]["p90"]
    assert high["tpot_ms"]["p50"] > low["tpot_ms"]["p50"]  # bigger batches, chunks beside them


def test_the_engines_scheduler_preempts_when_blocks_run_out(h200):
    reqs = _reqs(n=40, isl=256, osl=128)
    out = simulate(MODEL, h200, Deployment(layout="TP1", max_num_seqs=32, num_blocks=120), reqs)
    assert out["serve"]["completed"] == 40
    assert out["engines"][0]["preemptions"] > 0


def test_cache_aware_routing_finds_the_shared_prefixes(h200):
    reqs = shared_prefix_requests(200, systems=4, system_len=1024, user_len=32, output_len=16, vocab_size=32000,
                                  seed=1)
    runs = {router: simulate(MODEL, h200, Deployment(layout="TP1", replicas=4, router=router, prefix_caching=True),
                             reqs, rate=40.0) for router in ("cache_aware", "round_robin")}
    assert runs["cache_aware"]["routed"].get("prefix", 0) > 150
    assert runs["round_robin"]["routed"] == {"round_robin": 200}
    assert runs["cache_aware"]["serve"]["ttft_ms"]["mean"] < runs["round_robin"]["serve"]["ttft_ms"]["mean"]


def test_disaggregation_sends_long_prompts_to_the_prefill_engine(h200):
    reqs = mixed_requests(100, input_len=128, long_len=4096, long_share=0.2, output_len=32, vocab_size=32000, seed=2)
    d = Deployment(prefill="TP2", decode="TP2", min_prompt_tokens=1024)
    out = simulate(MODEL, h200, d, reqs, rate=10.0)
    long = sum(len(r.prompt) == 4096 for r in reqs)
    assert out["routed"] == {"prefill": long, "decode": 100 - long, "queue": 0}
    assert out["serve"]["completed"] == 100 and out["gpus"] == 4
    assert [e["engine"] for e in out["engines"]] == ["prefill0", "decode0"]
    assert out["serve"]["total_output_tokens"] == 100 * 32


def test_colocated_decode_engines_prefill_their_own_prompts(h200):
    reqs = mixed_requests(90, input_len=128, long_len=4096, long_share=0.3, output_len=32, vocab_size=32000, seed=2)
    d = Deployment(prefill="TP2", decode="TP2", decode_replicas=3, colocated_replicas=2, min_prompt_tokens=1024)
    out = simulate(MODEL, h200, d, reqs, rate=10.0)
    routed = out["routed"]
    assert sum(routed.values()) == 90 and routed["colocated"] > 0 and routed["prefill"] > 0
    assert out["serve"]["completed"] == 90 and out["gpus"] == 8
    plain = simulate(MODEL, h200, replace(d, colocated_replicas=0), reqs, rate=10.0)["routed"]
    assert plain["prefill"] == sum(len(r.prompt) == 4096 for r in reqs) and "colocated" not in plain
    with pytest.raises(ConfigError, match="colocated_replicas=3"):
        replace(d, colocated_replicas=3)


def test_speculation_keeps_what_it_accepts(h200):
    reqs = _reqs(n=20, isl=128, osl=64)
    plain = simulate(MODEL, h200, Deployment(layout="TP1"), reqs, rate=1.0)
    spec = simulate(MODEL, h200, Deployment(layout="TP1", spec_tokens=3, acceptance=1.0), reqs, rate=1.0)
    s = spec["engines"][0]["spec"]
    assert s["accepted"] == s["drafted"] > 0
    assert spec["serve"]["total_output_tokens"] == plain["serve"]["total_output_tokens"]
    assert spec["serve"]["tpot_ms"]["p50"] < 0.5 * plain["serve"]["tpot_ms"]["p50"]
    none = simulate(MODEL, h200, Deployment(layout="TP1", spec_tokens=3, acceptance=0.0), reqs, rate=1.0)
    assert none["engines"][0]["spec"]["accepted"] == 0
    assert none["serve"]["tpot_ms"]["p50"] >= plain["serve"]["tpot_ms"]["p50"]


def test_max_concurrency_is_a_closed_loop(h200):
    reqs = _reqs(n=60)
    out = simulate(MODEL, h200, Deployment(layout="TP1", max_num_seqs=64), reqs, max_concurrency=4)
    free = simulate(MODEL, h200, Deployment(layout="TP1", max_num_seqs=64), reqs)
    assert out["serve"]["completed"] == 60
    assert out["serve"]["ttft_ms"]["p90"] < free["serve"]["ttft_ms"]["p90"]
    assert out["serve"]["duration_s"] > free["serve"]["duration_s"]


def test_bad_input_is_one_line(h200):
    with pytest.raises(ConfigError, match="replicas"):
        Deployment(replicas=0)
    with pytest.raises(ConfigError, match="GPUs"):
        simulate(MODEL, h200, Deployment(layout="TP8", replicas=2), _reqs(n=2))
    with pytest.raises(ConfigError, match="max_concurrency"):
        simulate(MODEL, h200, Deployment(), _reqs(n=2), max_concurrency=0)
    with pytest.raises(ConfigError, match="no requests"):
        simulate(MODEL, h200, Deployment(), [])
    too_long = random_requests(1, input_len=200_000, output_len=8, vocab_size=100)
    out = simulate(MODEL, h200, Deployment(), too_long)
    assert out["serve"]["failed"] == 1 and "max_model_len" in out["serve"]["errors"][0]


@pytest.mark.parametrize("argv, words", [
    (["--request-rate", "0"], "--request-rate"),
    (["--num-prompts", "99999999999999999999"], "--num-prompts"),
    (["--layout", "TP3"], "tp=3"),
    (["--replicas", "0"], "replicas=0"),
    (["--speculative-config", '{"method": "ngram"}'], "--acceptance"),
])
def test_simulate_command_refuses_bad_flags_in_one_line(argv, words):
    p = subprocess.run([sys.executable, "-m", "atoll", "simulate", "--model", MODEL, "--topology", "dgx-h200",
                        "--no-progress", *argv], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("atoll: error:") and words in lines[0], p.stderr


def test_simulate_command_prints_the_bench_table():
    p = subprocess.run([sys.executable, "-m", "atoll", "simulate", "--model", MODEL, "--topology", "dgx-h200",
                        "--num-prompts", "40", "--request-rate", "8", "--input-len", "256", "--output-len", "32",
                        "-dp", "2", "--goodput", "ttft:500", "tpot:50", "--no-progress"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "2 x TP1" in p.stdout and "completed 40, failed 0" in p.stdout
    for row in ("TTFT", "TPOT", "ITL", "E2EL", "SLOs ttft:500 tpot:50", "replica1 (TP1): busy"):
        assert row in p.stdout, p.stdout


def test_bucket_is_exact_then_within_two_percent():
    assert [bucket(x) for x in (0, 1, 17, 64)] == [0, 1, 17, 64]
    for x in (65, 100, 1000, 12345, 10**6):
        assert abs(bucket(x) - x) <= 0.011 * x


def test_step_fit_recovers_a_known_step_and_the_simulator_takes_it(h200):
    def true(r, c, ctx, att):
        """A decode-only tick: 20 ms, + 1 ms a row up to 4 then 0.5 ms; one with chunks (the plain
        step): 30 ms + 3 ms a row + 50 us a chunk token; both + their context terms."""
        if c == 0:
            return 1e-6 * (20_000 + 1000 * min(r, 4) + 500 * max(r - 4, 0) + 2.0 * ctx / 1000)
        return 1e-6 * (30_000 + 3000 * r + 50 * c + 4.0 * ctx / 1000 + 0.1 * att / 1000)

    samples = [(r, c, ctx, att, true(r, c, ctx, att)) for r in (0, 1, 2, 4, 8, 16) for c in (0, 64, 512)
               for ctx, att in ((100.0 * max(r, 1), 10.0 * c), (4000.0 * max(r, 1), 300.0 * c)) if r or c]
    f = fit(samples)
    assert f.rel_rms < 1e-6 and f.chunk_token_us == pytest.approx(50, rel=1e-6)
    assert f.chunk_row_us == pytest.approx(3000, rel=1e-6) and f.rows[4] == pytest.approx(24_000, rel=1e-6)
    assert f.seconds(6, 100, 600, 2000) == pytest.approx(true(6, 100, 600, 2000), rel=1e-6)
    assert f.seconds(6, 0, 600, 0) == pytest.approx(true(6, 0, 600, 0), rel=1e-6)
    back = StepFit.from_dict(f.to_dict(), "x")
    for shape in ((2, 0, 300, 0), (3, 64, 500, 900)):
        assert back.seconds(*shape) == pytest.approx(true(*shape), rel=1e-3)
    # the calibration names the model and layout: the simulator's ticks are the fit's
    cal = Calibration(device="cuda", steps={"m": {"TP1": f.to_dict()}})
    topo = replace(h200, calibration=cal)
    reqs = _reqs(n=2, isl=64, osl=17)
    out = simulate(MODEL, topo, Deployment(layout="TP1"), reqs, rate=0.01, model_name="m")
    assert out["steps_from"] == "measured engine steps"
    want = sum(true(1, 0, c, 0) for c in range(65, 65 + 16)) / 16
    assert out["serve"]["tpot_ms"]["p50"] == pytest.approx(want * 1e3, rel=0.01)
    assert simulate(MODEL, topo, Deployment(layout="TP1"), reqs, model_name="other")["steps_from"] == "the cost model"


def test_step_fit_is_not_pulled_by_a_few_slow_ticks():
    """One tick in twenty three times as long (another process on the cores): the fit stays
    within 2% of the step, where plain least squares moves by about a tenth."""
    def true(r, c, ctx):
        return 1e-6 * ((20_000 + 1000 * r + 2.0 * ctx / 1000) if c == 0 else (30_000 + 3000 * r + 50 * c))

    shapes = [(r, c, 100.0 * r * k, 0.0) for k in (1, 2, 3) for r in (1, 2, 4, 8, 16) for c in (0, 64, 512)]
    samples = [(*s, true(*s[:3]) * (3 if i % 20 == 7 else 1)) for i, s in enumerate(shapes * 3)]
    f = fit(samples)
    for r, c in ((1, 0), (8, 0), (4, 64), (2, 512)):
        assert f.seconds(r, c, 100.0 * r, 0) == pytest.approx(true(r, c, 100.0 * r), rel=0.02), (r, c)
    # the slow ticks count squared in the RMS; a typical tick is still fitted well
    assert f.rel_median < 0.01 < f.rel_rms


def test_requests_sent_together_reach_an_idle_engine_one_by_one(h200):
    """The API server takes one request at a time (run.INTAKE_S): of four prompts sent at once to
    an idle engine, the first starts a tick alone and the other three join the next, as a server
    runs them, where four arriving in one instant would share a tick and their first tokens."""
    reqs = _reqs(n=4, isl=128, osl=8)
    p = prepare(MODEL, h200, Deployment(layout="TP1"), reqs)
    results, _ = Simulation(p.deployment, p.kinds, reqs, topology=h200, kv_bytes_per_token=p.kv_bytes_per_token).run()
    ttft = sorted(r.ttft for r in results)
    assert ttft[0] < 0.7 * ttft[1] and ttft[3] - ttft[1] < 3 * INTAKE_S
