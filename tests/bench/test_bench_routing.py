"""`atoll bench serve --scenario routing` without servers: its requests share the system
prompts, a side's figures are the differences of /metrics over the round, and a run
without replicas is one line."""

from cli import run_cli

from atoll.bench.serve_routing import render, side
from atoll.planner.sim.load import shared_prefix_requests


def test_requests_share_the_system_prompts():
    reqs = shared_prefix_requests(40, systems=3, system_len=8, user_len=2, output_len=4, vocab_size=50, seed=1)
    heads = {tuple(r.prompt[:8]) for r in reqs}
    assert len(reqs) == 40 and len(heads) == 3 and all(len(r.prompt) == 10 and r.output_len == 4 for r in reqs)
    again = shared_prefix_requests(40, systems=3, system_len=8, user_len=2, output_len=4, vocab_size=50, seed=1)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]


def test_a_side_is_the_round_s_difference():
    before = {"atoll_prompt_tokens_total": 10, "atoll_prompt_tokens_cached_total": 0,
              'atoll_router_requests_total{reason="least_loaded",replica="0"}': 2}
    after = {"atoll_prompt_tokens_total": 110, "atoll_prompt_tokens_cached_total": 80,
             "atoll_router_prompt_tokens_total": 100, "atoll_router_prefix_hit_tokens_total": 75,
             'atoll_router_requests_total{reason="least_loaded",replica="0"}': 3,
             'atoll_router_requests_total{reason="prefix",replica="1"}': 4}
    rep = {"completed": 5, "failed": 0, "duration_s": 1.0, "ttft_ms": {"mean": 2.0, "p50": 1.0},
           "e2el_ms": {"mean": 3.0, "p50": 3.0}, "output_throughput": 9.0}
    s = side(before, after, rep, models_cache=True)
    assert s["prefix_hit_rate"] == 0.8 and s["router_expected_hit_rate"] == 0.75
    assert s["routes"] == {"least_loaded": 1, "prefix": 4} and s["requests_per_replica"] == {"0": 1, "1": 4}
    rr = side(before, after, rep, models_cache=False)
    assert rr["router_expected_hit_rate"] is None
    text = render({"model": "m", "replicas": 2, "num_prompts": 5, "system_prompts": 1, "system_len": 8,
                   "user_len": 2, "output_len": 4, "request_rate": "inf",
                   "cache_aware": s | {"load_avg_1m_after": 1.0}, "round_robin": rr | {"load_avg_1m_after": 1.0},
                   "ttft_p50_round_robin_over_cache_aware": 1.0})
    assert "cache_aware      0.800    0.750" in text and "round_robin      0.800        -" in text


def test_routing_needs_replicas(capsys, tiny_model):
    code, _, err = run_cli(capsys, "bench", "serve", "--scenario", "routing", "--model", tiny_model("llama"))
    assert code == 2 and err.strip().endswith("--scenario routing needs replicas: give --data-parallel-size N (N >= 2)")
