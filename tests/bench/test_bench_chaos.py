"""`atoll bench serve --chaos SPEC`: the spec's faults (explicit and seeded random) with one-line
errors, the figures by phase around each fault, and one real run on a tiny model: a rank of one
of two replicas killed during the load, no request lost, every text equal to the no-fault run's,
the capacity back."""

import json

import pytest
from cli import run_cli

from atoll.bench.chaos_spec import Fault, outside_recovery, parse_chaos, percentile, phases
from atoll.errors import ConfigError
from atoll.planner.sim.report import RequestResult


def test_a_spec_gives_its_faults_in_time_order():
    faults = parse_chaos("stop@10:engine=1:for=3, kill@5, slow@15:ms=40:for=2:rank=1", engines=2)
    assert faults == [Fault("kill", 5.0), Fault("stop", 10.0, engine=1, for_s=3.0),
                      Fault("slow", 15.0, rank=1, for_s=2.0, ms=40.0)]
    assert faults[2].label() == "slow engine 0 rank 1 at 15 s for 2 s, 40 ms/100 ms"


def test_random_faults_repeat_with_their_seed_and_stay_within_bounds():
    a = parse_chaos("random:n=5:seed=7:within=20:kinds=kill+stop", engines=3)
    assert a == parse_chaos("random:n=5:seed=7:within=20:kinds=kill+stop", engines=3)
    assert a != parse_chaos("random:n=5:seed=8:within=20:kinds=kill+stop", engines=3)
    assert len(a) == 5 and all(1 <= f.at_s < 20 and 0 <= f.engine < 3 and f.kind in ("kill", "stop") for f in a)
    assert [f.at_s for f in a] == sorted(f.at_s for f in a)


def test_a_fault_every_period_on_seeded_random_engines():
    a = parse_chaos("random:n=10:seed=7:every=60", engines=2)
    assert [f.at_s for f in a] == [60.0 * (i + 1) for i in range(10)]
    assert all(f.kind == "kill" for f in a) and {f.engine for f in a} == {0, 1}
    assert a == parse_chaos("random:n=10:seed=7:every=60", engines=2)
    with pytest.raises(ConfigError, match="every= takes seconds above 0"):
        parse_chaos("random:n=2:every=60:within=30", engines=2)


@pytest.mark.parametrize("spec, message", [
    ("kill@5:engine=2", "engine=2 but the server has engines 0..1"),
    ("crash@5", "KIND one of kill, stop, slow"),
    ("kill@soon", "time='soon' must be a number"),
    ("slow@1:ms=150", "ms=150 must lie between 0 and 100"),
    ("stop@1:during=3", "'during=3' is not one of engine=, rank=, for=, ms="),
    ("random:n=2:kinds=kill+melt", "kinds from kill+stop+slow"),
    (" , ", "no fault given"),
])
def test_a_bad_spec_is_one_line_naming_its_part(spec, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("+", r"\+")):
        parse_chaos(spec, engines=2)


def _result(start, ttft, tpot, n=11):
    return RequestResult(success=True, output_tokens=n, ttft=ttft, latency=ttft + tpot * (n - 1), start=start)


def test_phases_split_the_requests_around_each_fault_and_its_recovery():
    results = [_result(0.5, 0.1, 0.01), _result(1.5, 0.2, 0.02),  # before
               _result(2.5, 1.0, 0.05), _result(3.0, 3.0, 0.05),  # during (fault at 2, back at 4)
               _result(4.5, 0.1, 0.01), RequestResult(error="HTTP 500", start=5.0)]  # after; a failure not counted
    [row] = phases(results, [Fault("kill", 2.0)], [4.0], end_s=6.0)
    assert row["recovered_s"] == 2.0
    assert row["before"]["requests"] == 2 and row["during"]["requests"] == 2 and row["after"]["requests"] == 1
    assert row["before"]["ttft_p50_ms"] == pytest.approx(150.0) and row["before"]["ttft_p99_ms"] == pytest.approx(199.0)
    assert row["during"]["ttft_p99_ms"] == pytest.approx(2980.0) and row["during"]["tpot_p50_ms"] == pytest.approx(50.0)
    assert row["after"]["tpot_p99_ms"] == pytest.approx(10.0)
    assert percentile([], 50) is None


def test_outside_recovery_leaves_out_every_request_alive_in_a_window():
    """Fault at 2 s, back at 4 s: a request sent before it but still decoding at 2 s is inside."""
    results = [_result(0.5, 0.1, 0.01),  # ends at 0.7: outside
               _result(1.5, 0.2, 0.1),  # ends at 2.7: alive during the window
               _result(3.0, 3.0, 0.05),  # sent during it
               _result(4.5, 0.3, 0.02)]  # outside
    clean = [_result(0.5, 0.1, 0.01), _result(1.0, 0.2, 0.01)]
    o = outside_recovery(results, clean, [Fault("kill", 2.0)], [4.0], end_s=6.0)
    assert o["requests"] == 2
    assert o["ttft_p99_ms"] == pytest.approx(298.0) and o["no_fault_ttft_p99_ms"] == pytest.approx(199.0)
    assert o["ttft_p99_over_no_fault"] == pytest.approx(298 / 199, rel=1e-3)
    assert o["tpot_p99_ms"] == pytest.approx(19.9) and o["tpot_p99_over_no_fault"] == pytest.approx(1.99)


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_killed_replica_rank_loses_no_request_and_changes_no_text(capsys, tiny_model):
    model = tiny_model("llama", max_position_embeddings=512)
    code, out, err = run_cli(capsys, "bench", "serve", "--model", model, "--chaos", "kill@2:engine=1",
                             "--data-parallel-size", "2", "--num-prompts", "12", "--request-rate", "3",
                             "--input-len", "8", "--output-len", "48", "--json", "--server-timeout", "240",
                             "--timeout", "240")
    r = json.loads(out)
    assert code == 0, (err, r)
    assert r["requests_lost"] == 0 and r["requests_failed"] == 0, r["failures"]
    assert r["texts_checked"] == 12 and r["texts_differing"] == 0
    [p] = r["phases"]
    assert p["fault"].startswith("kill engine 1 rank 0") and p["recovered_s"] is not None and p["recovered_s"] > 0
    assert p["before"]["requests"] + p["during"]["requests"] + p["after"]["requests"] == 12
    assert any("every engine serving again" in e for e in r["events"])
