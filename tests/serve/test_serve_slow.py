"""Slow before dead (issue 37), through the real openai client on 2 TP1 replicas: a replica whose
rank is stopped (SIGSTOP: a late heartbeat), slowed (--fault-injection delay: its steps are
outliers against its peer's) or silent (drop: no step within --stall-timeout-s) is drained: its
streams migrate with their tokens and finish with transformers' tokens and no error event, the
drain is counted by reason, and the replica is restarted (serve.drain, serve.replicas)."""

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest
from reference import reference_tokens
from serving import Server, with_tokenizer

NAME = "tiny"
STREAMS = 6
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})


def _prompts(n: int) -> list[list[int]]:
    return [[(13 * i + 7 * j) % 290 + 3 for j in range(4 + i % 5)] for i in range(n)]


async def _stream(c, prompt, new: int, got_one: asyncio.Event):
    ids = []
    try:
        async for chunk in await c.completions.create(model=NAME, prompt=prompt, max_tokens=new, stream=True,
                                                      **GREEDY):
            ids += chunk.choices[0].token_ids
            if ids:
                got_one.set()
    except openai.APIError as e:
        return ids, str(e)
    return ids, None


def _status(server) -> str:
    return httpx.get(f"{server.url}/health", timeout=10).json()["status"]


def _counted(m: dict, name: str, **labels) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in m.items() if k.startswith(name) and all(w in k for w in want))


def _serve_and_stream(tiny_model, tmp_path, new: int, *flags, during=None):
    """Start 2 replicas with `flags`, run STREAMS greedy streams (during(server, ranks) once every
    one streams), and check their tokens; returns (server, seconds from `during` to /health not ok)."""
    d = with_tokenizer(tiny_model("llama", max_position_embeddings=512), tmp_path / "m")
    prompts = _prompts(STREAMS)
    expected = reference_tokens(d, prompts, new)
    server = Server(d, "-dp", "2", "--router", "round_robin", "--served-model-name", NAME, *flags,
                    log=tmp_path / "server.log")
    ranks = server.rank_pids()
    assert len(ranks) == 2

    async def go():
        c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
        events = [asyncio.Event() for _ in prompts]
        tasks = [asyncio.create_task(_stream(c, p, new, e)) for p, e in zip(prompts, events)]
        await asyncio.wait_for(asyncio.gather(*[e.wait() for e in events]), 240)
        start = time.monotonic()
        if during is not None:
            during(ranks)
        noticed = None
        async with httpx.AsyncClient() as h:
            while during is not None and noticed is None and time.monotonic() - start < 60:
                if (await h.get(f"{server.url}/health", timeout=10)).json()["status"] != "ok":
                    noticed = time.monotonic() - start
                await asyncio.sleep(0.1)
        return await asyncio.wait_for(asyncio.gather(*tasks), 300), noticed

    try:
        results, noticed = asyncio.run(go())
        errors = [e for _, e in results if e is not None]
        assert not errors, (errors, server.text()[-3000:])
        assert [ids for ids, _ in results] == expected  # migrated with their tokens: none repeated or missing
        return server, ranks, noticed
    except BaseException:
        server.kill()
        raise


def _back(server) -> None:
    deadline = time.monotonic() + 240
    while _status(server) != "ok" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _status(server) == "ok", server.text()[-3000:]
    assert _counted(server.metrics(), "atoll_router_replica_restarts_total") >= 1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_stopped_rank_is_drained_within_the_heartbeat_timeout_and_restarted(tiny_model, tmp_path):
    server, ranks, noticed = _serve_and_stream(tiny_model, tmp_path, 160, "--heartbeat-timeout-s", "2",
                                               during=lambda ranks: os.kill(ranks[0], signal.SIGSTOP))
    try:
        print(f"\nSIGSTOP: /health not ok {noticed:.1f} s later")
        assert noticed is not None and noticed < 2 + 5, server.text()[-3000:]
        m = server.metrics()
        assert _counted(m, "atoll_router_replica_drains_total", reason="heartbeat") == 1, server.text()[-3000:]
        assert m["atoll_router_migrations_total"] >= 1
        assert "is drained (heartbeat)" in server.text()
        _back(server)
        assert ranks[0] not in server.rank_pids()  # the stopped rank was ended, a new one serves
    finally:
        server.kill()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_slowed_replica_is_an_outlier_and_is_drained(tiny_model, tmp_path):
    server, _, noticed = _serve_and_stream(
        tiny_model, tmp_path, 96, "--fault-injection", "delay:rank=0:ms=400:step=2:replica=1",
        "--slow-step-ratio", "3", "--slow-step-window", "4")
    try:
        m = server.metrics()
        assert _counted(m, "atoll_router_replica_drains_total", replica="1", reason="slow") >= 1, server.text()[-3000:]
        assert _counted(m, "atoll_router_replica_drains_total", replica="0") == 0  # the fast one serves on
        assert m["atoll_router_migrations_total"] >= 1
        assert "replica 1 is drained (slow): slow steps: median" in server.text()
        _back(server)
    finally:
        server.kill()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_replica_whose_messages_are_dropped_is_drained_by_the_stall_timeout(tiny_model, tmp_path):
    server, _, noticed = _serve_and_stream(
        tiny_model, tmp_path, 96, "--fault-injection", "drop:rank=0:step=3:replica=1", "--stall-timeout-s", "2")
    try:
        m = server.metrics()
        assert _counted(m, "atoll_router_replica_drains_total", replica="1", reason="stall") >= 1, server.text()[-3000:]
        assert m["atoll_router_migrations_total"] >= 1
        _back(server)
    finally:
        server.kill()
