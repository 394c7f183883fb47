"""The autoscaler's decisions made from the planner's step costs (serve.predict): the engines'
measured ticks read from their step traces against the simulator's StepCost for a tiny Llama on
the local topology, the correction factor they set, the queue-wait and TPOT estimates, and the
decisions those make before any attainment drops, without flapping."""

import json
import math

import pytest

from atoll.models.presets import resolve_model
from atoll.planner.sim.deploy import Deployment, engine_kind
from atoll.serve import predict
from atoll.serve.autoscale import Fleet, Goodput, Policy, Sample, decide
from atoll.serve.metrics import Metrics
from atoll.serve.predict import Predictor, Source
from atoll.serve.scaler import Scaler
from atoll.topologies import load_topology

POLICY = Policy(target=0.9, margin=0.05, interval_s=30, window_s=30, min_samples=3)
PROMPT = 200  # the waiting requests' mean prompt tokens
BUDGET = 256  # the chunk budget


@pytest.fixture(scope="module")
def cost(tiny_model):
    """The simulator's StepCost of a TP1 engine of a tiny Llama on the local topology."""
    name, config = resolve_model(str(tiny_model("llama")))
    kind = engine_kind(config, load_topology("local"), Deployment(layout="TP1", max_num_seqs=8), "TP1", isl=PROMPT,
                       osl=32, model_name=name)
    return kind.step_cost()


def _tick(cost, rows, chunk, ctx, attended):
    return cost.tick(rows, chunk, ctx, attended)


def _write(path, engine, ticks, factor, cost):
    """Trace lines of these (rows, chunk tokens, ctx_sum, attended_sum), each measured at factor x
    the StepCost's predicted tick."""
    with open(path, "a") as f:
        for rows, chunk, ctx, attended in ticks:
            f.write(json.dumps({"engine": engine, "rows": rows, "chunk_tokens": chunk, "ctx_sum": ctx,
                                "attended_sum": attended, "ctx_padded": ctx,
                                "seconds": factor * _tick(cost, rows, chunk, ctx, attended)[1]}) + "\n")


def _samples(predictor, fleet, *, waiting, running, ttft_ok=1.0, n=6, end=100.0):
    """n looks 5 s apart with every first token and gap within the SLOs, and the predictor's estimates."""
    est = predictor.estimate(fleet, waiting=waiting, running=running, prompt=PROMPT)
    return [Sample(end - 5.0 * (n - 1 - i), ttft_ok, 1.0, waiting, 0.3, **est) for i in range(n)]


def test_the_queue_wait_is_its_chunks_predicted_ticks_and_one_more_engine_shortens_it(cost):
    p = Predictor({"decode": cost}, [], budget=BUDGET)
    est = p.estimate(Fleet(replicas=1, free=1), waiting=6, running=2, prompt=PROMPT)
    ticks = math.ceil(6 * PROMPT / BUDGET)  # 1200 tokens in chunks of 256
    one = _tick(cost, 2, BUDGET, 2 * PROMPT, BUDGET * PROMPT / 2)[0]
    assert est["queue_s"] == pytest.approx(ticks * one, rel=1e-9)
    assert est["correction"] == 1.0
    two = _tick(cost, 1, BUDGET, PROMPT, BUDGET * PROMPT / 2)[0]
    assert est["queue_more_s"] == pytest.approx(math.ceil(3 * PROMPT / BUDGET) * two, rel=1e-9)
    assert est["queue_more_s"] < est["queue_s"] / 1.5
    assert p.estimate(Fleet(replicas=1), waiting=0, running=0, prompt=PROMPT) == {
        "correction": 1.0, "tpot_correction": 1.0, "queue_s": 0.0, "queue_more_s": 0.0}


def test_a_queue_that_will_miss_ttft_adds_a_replica_before_attainment_drops(cost):
    p = Predictor({"decode": cost}, [], budget=BUDGET)
    fleet = Fleet(replicas=1, free=1)
    wait = p.estimate(fleet, waiting=12, running=2, prompt=PROMPT)["queue_s"]
    slo = Goodput(ttft_s=wait / 2, tpot_s=60.0)  # the queue now waits twice the TTFT SLO; no token is late yet
    d = decide(_samples(p, fleet, waiting=12, running=2), fleet, slo, POLICY, now=100, last_at=None)
    assert (d.action, d.role) == ("add", "replica")
    assert "TTFT attainment" not in d.reason  # attainment is 100%: the prediction alone decided
    assert f"estimated wait {wait * 1000:.0f} ms (predicted x correction 1.00)" in d.reason
    assert "estimated wait with it" in d.reason
    # a queue of two requests is predicted to make it: nothing to do
    assert decide(_samples(p, fleet, waiting=2, running=2), fleet, slo, POLICY, now=100, last_at=None) is None


def test_a_correction_factor_of_2_measured_from_the_trace_changes_the_decision(cost, tmp_path):
    trace = tmp_path / "replica0.jsonl"
    p = Predictor({"decode": cost}, [Source(str(trace), "replica 0", own=True)], budget=BUDGET)
    fleet = Fleet(replicas=1, free=1)
    predicted = p.estimate(fleet, waiting=6, running=2, prompt=PROMPT)["queue_s"]
    slo = Goodput(ttft_s=1.5 * predicted, tpot_s=60.0)
    assert decide(_samples(p, fleet, waiting=6, running=2), fleet, slo, POLICY, now=100, last_at=None) is None
    # the engine's measured ticks take twice the predicted time (decode ticks and prefill chunks),
    # their rows at the context the estimate assumed before any tick (the mean prompt)
    _write(trace, "engine", [(r, 0, r * PROMPT, 0.0) for r in (1, 2, 4, 8)] + [(1, 128, PROMPT, 128 * 64.0)] * 3,
           2.0, cost)
    with open(trace, "a") as f:
        f.write('{"engine": "engine", "rows": 1')  # a line still being written: read next time
    est = p.estimate(fleet, waiting=6, running=2, prompt=PROMPT)
    assert est["correction"] == pytest.approx(2.0, rel=1e-9)
    assert est["queue_s"] == pytest.approx(2.0 * predicted, rel=1e-9)
    view = p.view()["replica 0"]
    assert view["ticks"] == 7 and view["correction"] == pytest.approx(2.0)
    assert view["line"].startswith("replica 0: predicted step ") and "x correction 2.00" in view["line"]
    d = decide(_samples(p, fleet, waiting=6, running=2), fleet, slo, POLICY, now=100, last_at=None)
    assert (d.action, d.role) == ("add", "replica") and "correction 2.00" in d.reason


def test_prompt_chunk_ticks_correct_the_queue_and_decode_ticks_correct_tpot(cost, tmp_path):
    trace = tmp_path / "steps.jsonl"
    p = Predictor({"decode": cost}, [Source(str(trace), None)], budget=BUDGET)
    fleet = Fleet(replicas=1, free=1)
    before = p.estimate(fleet, waiting=6, running=2, prompt=PROMPT)
    _write(trace, "engine", [(r, 0, r * PROMPT, 0.0) for r in (1, 2, 4, 8, 2)], 1.5, cost)  # decode-only ticks
    _write(trace, "engine", [(1, 128, PROMPT, 128 * 64.0)] * 3, 4.0, cost)  # ticks with prompt chunks
    after = p.estimate(fleet, waiting=6, running=2, prompt=PROMPT)
    assert (after["correction"], after["tpot_correction"]) == (pytest.approx(4.0), pytest.approx(1.5))
    assert after["queue_s"] == pytest.approx(4.0 * before["queue_s"], rel=1e-9)
    assert after["tpot_s"] == pytest.approx(1.5 * before["tpot_s"], rel=1e-9)
    view = p.view()["engine"]
    assert view["correction"] == pytest.approx(1.5)  # the median over all 8 ticks
    assert (view["correction_chunked"], view["correction_decoding"]) == (4.0, 1.5)
    assert view["line"].endswith("ticks; prompt-chunk ticks 4.00, decode ticks 1.50)")


def test_the_tpot_estimate_adds_a_decode_engine_and_keeps_a_drain_that_would_miss_it(cost):
    p = Predictor({"prefill": cost, "decode": cost}, [], budget=BUDGET)
    disagg = Fleet(prefill=1, decode=1, free=1, threshold=256, base_threshold=256)
    tpot = p.estimate(disagg, waiting=0, running=8, prompt=PROMPT)["tpot_s"]
    assert tpot == pytest.approx(_tick(cost, 8, 0, 8 * PROMPT, 0)[0], rel=1e-9)
    d = decide(_samples(p, disagg, waiting=0, running=8), disagg, Goodput(60.0, tpot / 1.5), POLICY, now=100,
               last_at=None)
    assert (d.action, d.role) == ("add", "decode") and "estimated TPOT" in d.reason
    # two idle-looking replicas whose batch one alone would run over the TPOT SLO: no drain
    two = Fleet(replicas=2)
    fewer = p.estimate(two, waiting=0, running=8, prompt=PROMPT)["tpot_less_s"]
    now_tpot = p.estimate(two, waiting=0, running=8, prompt=PROMPT)["tpot_s"]
    assert now_tpot < fewer
    tight = Goodput(60.0, (now_tpot + fewer) / 2)  # met by two, missed by one
    assert decide(_samples(p, two, waiting=0, running=8), two, tight, POLICY, now=100, last_at=None) is None
    d = decide(_samples(p, two, waiting=0, running=8), two, Goodput(60.0, 2 * fewer), POLICY, now=100, last_at=None)
    assert (d.action, d.role) == ("drain", "replica")


def test_an_estimate_hovering_at_the_slo_never_flaps_and_one_over_it_decides_once_per_interval(cost):
    fleet, slo = Fleet(replicas=1, free=1), Goodput(ttft_s=0.5, tpot_s=60.0)
    wobble = [Sample(t, 1.0, 1.0, 3.0, 0.3, queue_s=0.44 if (t // 5) % 2 else 0.55) for t in range(0, 600, 5)]
    made = [decide(wobble[:i + 1], fleet, slo, POLICY, now=s.at, last_at=None) for i, s in enumerate(wobble)]
    assert [d for d in made if d is not None] == []
    over = [Sample(t, 1.0, 1.0, 3.0, 0.3, queue_s=0.8) for t in range(0, 300, 5)]
    last, at = None, []
    for i, s in enumerate(over):
        if decide(over[:i + 1], fleet, slo, POLICY, now=s.at, last_at=last) is not None:
            last, at = s.at, at + [s.at]
    assert at == list(range(10, 300, 30))


def test_a_trace_the_server_made_is_emptied_once_read_past_its_size(cost, tmp_path, monkeypatch):
    monkeypatch.setattr(predict, "KEEP_BYTES", 500)
    trace = tmp_path / "steps.jsonl"
    p = Predictor({"decode": cost}, [Source(str(trace), None, own=True)], budget=BUDGET)
    _write(trace, "engine", [(2, 0, 600.0, 0.0)] * 8, 3.0, cost)
    p.poll()
    assert trace.stat().st_size == 0 and p.view()["engine"]["ticks"] == 8
    _write(trace, "engine", [(2, 0, 600.0, 0.0)] * 2, 3.0, cost)
    assert p.view()["engine"]["ticks"] == 10 and p.factor("decode") == pytest.approx(3.0)


class _Target:
    """What a Scaler acts on, in memory: one replica serving, one free, the load given."""

    def __init__(self, stats):
        self.stats_now, self.lines, self.done = stats, [], []

    def stats(self):
        return self.stats_now

    def fleet(self):
        return Fleet(replicas=1, free=1)

    def act(self, d):
        self.done.append(d)
        return 1, True

    def log(self, line):
        self.lines.append(line)


def test_the_scaler_estimates_from_the_prompts_finished_less_their_cached_tokens(cost):
    p = Predictor({"decode": cost}, [Source("/nonexistent/replica0.jsonl", "replica 0")], budget=BUDGET)
    metrics = Metrics()
    # two finished requests: 300 prompt tokens each, 100 of them found in the prefix cache
    for _ in range(2):
        metrics.request_finished({"finish_reason": "length", "metrics": {"prompt_tokens": 300, "cached_tokens": 100}},
                                 arrived=0.0, now=1.0)
    target = _Target({"waiting": 12, "running": 2, "blocks_in_use": 10, "num_blocks": 100})
    wait = p.estimate(Fleet(replicas=1, free=1), waiting=12, running=2, prompt=PROMPT)["queue_s"]  # 200 computed
    scaler = Scaler(target, metrics, Goodput(ttft_s=wait / 2, tpot_s=60.0),
                    Policy(interval_s=10, window_s=10, min_samples=3), predictor=p)
    made = [scaler.tick(now=t) for t in (0.0, 1.0, 2.0, 3.0)]
    assert made[:2] == [None, None] and made[2].action == "add" and made[3] is None  # then the interval holds
    assert scaler.history[-1].queue_s == pytest.approx(wait, rel=1e-9)
    assert len(target.lines) == 1 and "estimated wait" in target.lines[0]
    assert target.lines[0].endswith("[steps: replica 0: no step measured yet (correction 1.00)]")
    entry = scaler.decisions[0]
    assert entry["estimated_queue_ms"] == pytest.approx(wait * 1000, rel=1e-3) and entry["correction"] == 1.0
