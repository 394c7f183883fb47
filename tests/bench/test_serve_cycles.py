"""`atoll bench serve --step-trace FILE` reports the measured round's step cycles from the
engines' own trace, and the expert rebalances the server made in that round (bench/serve_cycles.py)."""

import json
import os
import signal
import subprocess
import sys

import pytest

from atoll.bench.eplb import skewed_moe
from atoll.bench.serve_cycles import Cycles, rebalances, step_cycles


def tick(start, seconds, rows, chunk=0, engine="engine"):
    return {"engine": engine, "rows": rows, "chunk_tokens": chunk, "start": start, "seconds": seconds}


def test_cycles_run_from_tick_end_to_tick_end_and_skip_idle_waits():
    ticks = [tick(0.0, 0.010, 0, chunk=32),  # a prompt alone
             tick(0.012, 0.010, 1),  # decode: cycle 0.012
             tick(0.024, 0.010, 1),  # decode: cycle 0.012
             tick(0.134, 0.010, 1),  # decode after 100 ms of work between steps (a rebalance): cycle 0.110
             tick(0.146, 0.010, 1),
             tick(5.0, 0.010, 0, chunk=32),  # the engine sat idle for seconds: a prompt tick, no cycle
             tick(5.012, 0.010, 1)]
    c = step_cycles(ticks)["engine"]
    assert c["cycles"] == 5
    assert c["median_ms"] == pytest.approx(12.0)
    assert c["longest_ms"] == pytest.approx(110.0)
    assert c["longest_over_median"] == pytest.approx(110 / 12, rel=1e-3)


def test_cycles_by_engine_and_in_start_order():
    ticks = [tick(0.02, 0.01, 2, engine="b"), tick(0.0, 0.01, 2, engine="b"), tick(0.0, 0.01, 2, engine="a")]
    out = step_cycles(ticks)
    assert set(out) == {"b"} and out["b"]["median_ms"] == pytest.approx(20.0)


def test_the_round_is_read_between_marks_and_rebalances_counted(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in [tick(0, 0.5, 1), tick(1, 0.5, 1)]))  # before the round
    samples = iter([{"atoll_eplb_rebalances": 3.0}, {"atoll_eplb_rebalances": 7.0}])
    cycles = Cycles(str(path))
    cycles.round_start(lambda: next(samples))
    with open(path, "a") as f:
        f.writelines(json.dumps(t) + "\n" for t in [tick(10, 0.01, 1), tick(10.02, 0.01, 1), tick(10.04, 0.01, 1)])
        f.write('{"engine": "engine", "rows"')  # a line still being written is left out
    cycles.round_end(lambda: next(samples))
    r = cycles.report()
    assert r["rebalances"] == 4
    assert r["engines"]["engine"]["cycles"] == 2 and r["engines"]["engine"]["median_ms"] == pytest.approx(20.0)
    assert rebalances({"atoll_requests_total": 1.0}) is None


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_serve_reports_cycles_under_rebalancing(tmp_path):
    """A skewed DeepSeek-V3 at EP2 with 2 redundant slots, served by `atoll bench serve` with a
    rebalance every 4 steps: the round's decode step cycles and its rebalances come back."""
    model = skewed_moe(tmp_path / "moe")
    trace = tmp_path / "steps.jsonl"
    cmd = [sys.executable, "-m", "atoll", "bench", "serve", "--json", "--model", str(model), "--num-prompts", "8",
           "--input-len", "16", "--output-len", "24", "--request-rate", "inf", "--layout", "EP2",
           "--enable-eplb", "--num-redundant-experts", "2", "--eplb-window-size", "4", "--eplb-step-interval", "4",
           "--expert-load-interval", "4",
           "--step-trace", str(trace), "--max-num-seqs", "8", "--max-model-len", "128", "--timeout", "120",
           "--server-timeout", "180"]
    env = {**os.environ, "ATOLL_ENFORCE_EAGER": "1", "ATOLL_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=360)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        finally:
            proc.kill()
        pytest.fail("atoll bench serve did not finish in 360 s")
    assert proc.returncode == 0, err[-2000:]
    r = json.loads(out)
    assert r["serve"]["completed"] == 8
    c = r["step_cycles"]
    assert c["rebalances"] >= 1
    (engine,) = c["engines"].values()
    assert engine["cycles"] >= 8 and 0 < engine["median_ms"] <= engine["longest_ms"]
