"""--compare-plan's speed probe (bench/serve_probe.py): the machine's speed now against the
calibration's fitted ticks, and the simulation scaled by it."""

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace

import pytest
import yaml

from atoll.bench.serve_probe import MIN_TICKS, scale, scaled_topology, speed_factor
from atoll.engine.rank.trace import read_ticks
from atoll.planner.sim.api import Deployment, simulate
from atoll.planner.sim import run as sim_run
from atoll.planner.sim.load import random_requests
from atoll.planner.sim.stepfit import StepFit
from atoll.topologies import load_topology
from atoll.topologies.calibration import Calibration

MODEL = "Llama-3.1-8B"
FIT = StepFit(rows={1: 20_000.0, 8: 34_000.0}, chunk_token_us=400.0, ctx_kilotoken_us=3.0,
              attended_kilotoken_us=0.5, chunk_base_us=25_000.0, chunk_row_us=800.0, chunk_ctx_kilotoken_us=2.0)


def _tick(engine, rows, chunk, ctx, fit, times):
    return (engine, rows, chunk, ctx, 10.0 * chunk, times * fit.seconds(rows, chunk, ctx, 10.0 * chunk), ctx, None)


def test_speed_factor_is_the_median_of_measured_over_fitted():
    ticks = [_tick("engine", r, c, 100.0 * r, FIT, 1.3) for r in (1, 2, 4, 8) for c in (0, 0, 64)]
    ticks.append(_tick("engine", 2, 0, 200.0, FIT, 9.0))  # one tick slowed by something else
    ticks.append(("engine", 0, 0, 0.0, 0.0, 0.5, 0.0, None))  # an idle tick: not a step of the fit's
    factor, n = speed_factor(ticks, [FIT])
    assert factor == pytest.approx(1.3) and n == 13
    assert speed_factor(ticks[:MIN_TICKS - 1], [FIT]) == (None, MIN_TICKS - 1)
    assert speed_factor(ticks, [None]) == (None, 0)


def test_a_decode_engine_is_timed_by_the_decode_fit():
    slow = scale(FIT, 2.0)
    ticks = [_tick("prefill engine", 0, 64, 0.0, FIT, 1.0) for _ in range(5)]
    ticks += [_tick("decode engine", r, 0, 50.0 * r, slow, 1.5) for r in (1, 2, 3, 4, 5, 6)]
    # each tick against its own engine's fit: 1.0 for the prefill ones, 1.5 for the decode ones
    factor, n = speed_factor(ticks, [FIT, slow])
    assert n == 11 and factor == pytest.approx(1.5)
    assert speed_factor(ticks, [FIT, FIT])[0] == pytest.approx(3.0)  # the wrong fit is seen


def test_scale_multiplies_every_term():
    s = scale(FIT, 1.7)
    for shape in ((1, 0, 300, 0, None), (5, 0, 900, 0, None), (3, 128, 400, 2000, None)):
        assert s.seconds(*shape) == pytest.approx(1.7 * FIT.seconds(*shape), rel=1e-12)


def test_a_burst_simulated_with_a_scaled_fit_takes_factor_times_as_long(monkeypatch):
    monkeypatch.setattr(sim_run, "INTAKE_S", 0.0)  # the API server's intake is not scaled: left out here
    topo = replace(load_topology("dgx-h200"), calibration=Calibration(device="cuda", steps={"m": {"TP1": FIT.to_dict()}}))
    reqs = random_requests(6, input_len=48, output_len=12, vocab_size=32000, seed=3)
    base = simulate(MODEL, topo, Deployment(layout="TP1"), reqs, model_name="m")["serve"]
    fast = simulate(MODEL, scaled_topology(topo, "m", 0.6), Deployment(layout="TP1"), reqs, model_name="m")["serve"]
    for group in ("ttft_ms", "tpot_ms", "e2el_ms"):  # every request at t=0: every time scales
        assert fast[group]["p50"] == pytest.approx(0.6 * base[group]["p50"], rel=1e-3), group


def test_read_ticks_between_offsets_skips_a_line_being_written(tmp_path):
    path = tmp_path / "trace.jsonl"
    line = {"engine": "engine", "rows": 2, "chunk_tokens": 0, "ctx_sum": 40.0, "attended_sum": 0.0,
            "ctx_padded": 64.0, "seconds": 0.05, "graph": True}
    path.write_text(json.dumps(line) + "\n")
    mid = os.path.getsize(path)
    with open(path, "a") as f:
        f.write(json.dumps(line | {"rows": 3}) + "\n" + json.dumps(line)[:20])
    assert [t[1] for t in read_ticks(path)] == [2, 3]
    assert [t[1] for t in read_ticks(path, mid)] == [3]
    assert read_ticks(path, 0, mid) == [("engine", 2, 0, 40.0, 0.0, 0.05, 64.0, True)]


@pytest.mark.slow
def test_bench_serve_probes_the_speed_and_simulates_with_it(tiny_model, tmp_path):
    """A server started with a topology holding a fit for its model: the probe's ticks give a
    factor, the simulation is scaled by it (a burst: every figure by that much, less the fixed intake), and the
    uncorrected simulation is kept beside; the probe's trace file is gone afterwards."""
    model = tiny_model("llama")
    topo = {"name": "probe-test", "gpus_per_node": 2,
            "gpu": {"name": "cpu-core", "memory_gib": 8, "hbm_tb_s": 0.015, "bf16_tflops": 0.2, "fp32_tflops": 0.09},
            "islands": 1, "links": {"pcie": {"kind": "shm", "gb_s": 2.6, "latency_us": 387},
                                            "network": {"kind": "ethernet", "gb_s": 1.25, "latency_us": 50}},
            "calibration": {"device": "cpu", "cores": 2, "steps": {model.name: {"TP1": FIT.to_dict()}}}}
    (tmp_path / "topo.yaml").write_text(yaml.safe_dump(topo))
    cmd = [sys.executable, "-m", "atoll", "bench", "serve", "--json", "--model", str(model), "--num-prompts", "4",
           "--input-len", "8", "--output-len", "12", "--request-rate", "inf", "--compare-plan", "--topology",
           str(tmp_path / "topo.yaml"), "--max-num-seqs", "4", "--max-model-len", "64", "--timeout", "60",
           "--server-timeout", "60"]
    env = {**os.environ, "ATOLL_ENFORCE_EAGER": "1", "ATOLL_CACHE": str(tmp_path / "cache"), "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        finally:
            proc.kill()
        pytest.fail("atoll bench serve did not finish in 150 s")
    assert proc.returncode == 0, err[-2000:]
    p = json.loads(out)["plan"]
    sp = p["speed"]
    assert sp["probe_ticks"] >= MIN_TICKS and sp["factor"] > 0 and sp["during_run"] > 0
    corrected, plain = p["measured_over_simulated"], p["measured_over_simulated_uncorrected"]
    # every step is scaled by the factor; the API server's intake (planner/sim/run.py INTAKE_S a
    # request) is not, so each figure moves by the factor less that fixed share
    lo, hi = sorted((sp["factor"], 1.0))
    for k in ("ttft_p50", "tpot_p50", "e2el_p50"):
        ratio = plain[k] / corrected[k]
        assert lo * 0.99 <= ratio <= hi * 1.01 and ratio == pytest.approx(sp["factor"], rel=0.25), (k, ratio)
    assert not list(tmp_path.glob("atoll-probe-*"))
