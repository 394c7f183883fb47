"""`atoll serve --data-parallel-size 2` (or a plan's `replicas: 2`) on a dense model: two engine
replicas behind the router, through the real openai client. Cache-aware: a prompt goes to the replica that computed its
prefix (cached_tokens says the engine reused it) and greedy tokens equal transformers'.
Round-robin with a replica killed and --restart-policy never: its streaming request continues on
the other replica with its tokens (a migration, tests/serve/test_serve_migration.py has the
tokens), its queued one is served by the other replica, /health says degraded (200), and once
both are dead the server exits 2 with one line."""

import asyncio
import os
import signal

import httpx
import openai
import pytest
import yaml
from cli import run_cli
from reference import reference_tokens
from serving import Server, with_tokenizer

from atoll.planner.planfile import load_plan

NAME = "tiny"
NEW = 6
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
SYSTEM_A, SYSTEM_B = list(range(10, 50)), list(range(100, 140))  # 40 tokens: two full blocks of 16
SIM = dict(name="sim-2", gpus_per_node=2, islands=1, gpu=dict(name="sim", memory_gib=16, hbm_tb_s=1, bf16_tflops=100),
           links=dict(nvlink=dict(gb_s=100, latency_us=3), pcie=dict(gb_s=10, latency_us=5),
                      network=dict(kind="ethernet", gb_s=1.25, latency_us=50, shared=True)))
PROMPTS = [SYSTEM_A + [60, 61], SYSTEM_B + [62], SYSTEM_A + [70, 71, 72], SYSTEM_B + [73, 74]]


def client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


async def _complete(c, prompt, *, stream: bool, max_tokens: int = NEW):
    if not stream:
        r = await c.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, **GREEDY)
        return r.choices[0].token_ids, r.usage.prompt_tokens_details.cached_tokens
    ids = []
    async for chunk in await c.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, stream=True,
                                                  **GREEDY):
        ids += chunk.choices[0].token_ids
    return ids, None


def _plan_of_two_replicas(capsys, model_dir, tmp_path):
    """`atoll plan --save` for exactly 2 replicas of TP1 on a simulated node of 2 GPUs."""
    topo = tmp_path / "sim.yaml"
    topo.write_text(yaml.safe_dump(SIM))
    out = tmp_path / "plan.yaml"
    code, _, err = run_cli(capsys, "plan", "--isl", "64", "--osl", "16", "--model", model_dir, "--topology", topo,
                           "--layouts", "2 x TP1", "--save", out)
    assert code == 0, err
    assert load_plan(out).replicas == 2
    return out


@pytest.mark.timeout(300)
def test_cache_aware_replicas_route_by_prefix_with_transformers_tokens(tiny_model, tmp_path, capsys):
    d = with_tokenizer(tiny_model("llama"), tmp_path / "m")
    expected = reference_tokens(d, PROMPTS, NEW)
    plan = _plan_of_two_replicas(capsys, d, tmp_path)  # a plan's replicas are served as -dp 2 would be
    server = Server(d, "--plan", plan, "--served-model-name", NAME, log=tmp_path / "server.log")
    try:
        assert "x 2 replicas, cache_aware router" in server.text()
        assert len(server.rank_pids()) == 2

        async def go():
            c = client(server)
            first = await asyncio.gather(*[_complete(c, p, stream=False) for p in PROMPTS[:2]])
            second = await asyncio.gather(_complete(c, PROMPTS[2], stream=False),
                                          _complete(c, PROMPTS[3], stream=True))
            return first, second

        first, second = asyncio.run(go())
        assert [ids for ids, _ in first + second] == expected
        assert [cached for _, cached in first] == [0, 0] and second[0][1] == 32
        m = server.metrics()
        routed = {k: v for k, v in m.items() if k.startswith("atoll_router_requests_total")}
        # the two system prompts went to different replicas, and each follow-up to its own
        assert routed == {'atoll_router_requests_total{reason="least_loaded",replica="0"}': 1.0,
                          'atoll_router_requests_total{reason="least_loaded",replica="1"}': 1.0,
                          'atoll_router_requests_total{reason="prefix",replica="0"}': 1.0,
                          'atoll_router_requests_total{reason="prefix",replica="1"}': 1.0}, routed
        assert m["atoll_router_prefix_hit_tokens_total"] == 64 and m["atoll_prompt_tokens_cached_total"] == 64
        assert m["atoll_kv_events_published"] >= 4  # each replica named its system prompt's two blocks
        assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}
        os.kill(server.pid, signal.SIGTERM)
        assert server.wait(60) == 0
    finally:
        server.kill()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_replica_stays_down_under_never_and_its_requests_go_on(tiny_model, tmp_path):
    d = with_tokenizer(tiny_model("llama", max_position_embeddings=16384), tmp_path / "m")
    short = [5, 7, 9]
    expected = reference_tokens(d, [short], NEW)[0]
    server = Server(d, "-dp", "2", "--router", "round_robin", "--max-num-seqs", "1", "--served-model-name", NAME,
                    "--restart-policy", "never", log=tmp_path / "server.log")
    try:
        ranks = server.rank_pids()
        assert len(ranks) == 2

        async def long_stream(c, started: asyncio.Event):
            ids = []
            try:
                async for chunk in await c.completions.create(model=NAME, prompt=[11, 12], max_tokens=16000,
                                                              stream=True, **GREEDY):
                    ids += chunk.choices[0].token_ids
                    started.set()
            except openai.APIError as e:
                return ids, e
            return ids, None

        async def go():
            c = client(server)
            started = [asyncio.Event(), asyncio.Event()]
            longs = [asyncio.create_task(long_stream(c, e)) for e in started]  # replicas 0 and 1
            await asyncio.wait_for(asyncio.gather(*[e.wait() for e in started]), 60)
            queued = [asyncio.create_task(_complete(c, short, stream=False)) for _ in range(2)]  # 0 and 1 again
            for _ in range(100):  # both wait behind the long streams (one sequence per replica)
                if server.metrics().get("atoll_num_requests_waiting") == 2:
                    break
                await asyncio.sleep(0.1)
            os.kill(ranks[0], signal.SIGKILL)
            migrated = await asyncio.to_thread(server.wait_metric, "atoll_router_migrations_total", 1, 60)
            for t in longs:  # both long streams go on (one migrated): the clients leave, the slots free
                t.cancel()
            return migrated, await asyncio.wait_for(asyncio.gather(*queued), 90)

        migrated, queued = asyncio.run(go())
        assert migrated == 1
        assert [ids for ids, _ in queued] == [expected, expected]  # the dead replica's one, retried
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
        [dead] = list(health.json()["dead"])
        assert "killed by SIGKILL" in health.json()["dead"][dead], health.text
        m = server.metrics()
        assert m["atoll_router_retries_total"] == 2  # the queued request and the migrated stream
        assert m[f'atoll_router_replica_up{{replica="{dead}"}}'] == 0
        assert not any(k.startswith("atoll_router_replica_restarts_total") and v for k, v in m.items())
        r = asyncio.run(_complete(client(server), short, stream=True))
        assert r[0] == expected  # the live one keeps serving
        os.kill(ranks[1], signal.SIGKILL)
        assert server.wait(60) == 2
        lines = [line for line in server.text().splitlines() if line.startswith("atoll: error:")]
        assert len(lines) == 1 and "every replica failed" in lines[0], server.text()
    finally:
        server.kill()
