"""Serving that heals (issue 37), through the real openai client: 2 TP1 replicas, one rank
killed with SIGKILL while streams run on both. Every stream finishes with transformers' tokens
and no error event: those on the dead replica continue on the live one with the tokens they had
(serve.replicas), a seeded sampled stream draws the same tokens as a run without the fault
(engine.sample.sampler.stream_seed), and the dead replica is started again and serves, /health
back to ok (serve.restarts)."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from reference import reference_tokens
from serving import Server, with_tokenizer

NAME = "tiny"
NEW = 480
STREAMS = 16
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
SEEDED = dict(temperature=0.9, seed=7, extra_body={"ignore_eos": True, "return_token_ids": True})


def _prompts(n: int) -> list[list[int]]:
    return [[(17 * i + 5 * j) % 290 + 3 for j in range(3 + i % 7)] for i in range(n)]


async def _stream(c, prompt, params, got_one: asyncio.Event):
    """(token ids, error events seen): an error event ends the stream as an APIError."""
    ids = []
    try:
        async for chunk in await c.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, stream=True,
                                                      **params):
            ids += chunk.choices[0].token_ids
            if ids:
                got_one.set()
    except openai.APIError as e:
        return ids, str(e)
    return ids, None


def _health(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=10).json()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_replica_loses_no_stream_and_comes_back(tiny_model, tmp_path):
    d = with_tokenizer(tiny_model("llama", max_position_embeddings=512), tmp_path / "m")
    prompts = _prompts(STREAMS)
    expected = reference_tokens(d, prompts, NEW)
    # 4 ms a step: a tiny model would otherwise finish a replica's streams (the server buffering
    # them) before the client sees every stream's first token, and the kill would find nothing to move
    server = Server(d, "-dp", "2", "--router", "round_robin", "--max-num-seqs", "16", "--served-model-name", NAME,
                    "--fault-injection", "delay:rank=0:ms=4", log=tmp_path / "server.log")
    try:
        def client():  # one per event loop: a client's connections belong to the loop that made them
            return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)

        seeded_prompt = prompts[0]

        async def seeded_alone():
            return await _stream(client(), seeded_prompt, SEEDED, asyncio.Event())

        calm = asyncio.run(seeded_alone())  # the seeded stream without a fault
        assert calm[1] is None and len(calm[0]) == NEW
        ranks = server.rank_pids()
        assert len(ranks) == 2

        async def go():
            c = client()
            events = [asyncio.Event() for _ in range(STREAMS + 2)]
            # round robin: the seeded streams land on both replicas, one of them the one killed
            tasks = [asyncio.create_task(_stream(c, seeded_prompt, SEEDED, events[0]))]
            tasks += [asyncio.create_task(_stream(c, p, GREEDY, e)) for p, e in zip(prompts, events[1:])]
            tasks.append(asyncio.create_task(_stream(c, seeded_prompt, SEEDED, events[-1])))
            await asyncio.wait_for(asyncio.gather(*[e.wait() for e in events]), 240)  # every one streaming
            os.kill(ranks[0], signal.SIGKILL)
            killed = time.monotonic()
            return await asyncio.wait_for(asyncio.gather(*tasks), 300), killed

        results, killed = asyncio.run(go())
        errors = [e for _, e in results if e is not None]
        assert not errors, errors
        greedy = [ids for ids, _ in results[1:-1]]
        assert greedy == expected  # no token repeated, none missing, transformers' tokens
        assert results[0][0] == calm[0] and results[-1][0] == calm[0]  # seeded: the same draws
        m = server.metrics()
        died = [k for k, v in m.items() if k.startswith("atoll_router_replica_restarts_total") and v]
        assert died or _health(server)["status"] == "degraded", (ranks, server.text()[-3000:])  # the kill hit a rank
        # the dead replica's streams went on with their tokens
        assert m["atoll_router_migrations_total"] >= 1, (m.get("atoll_router_retries_total"), server.text()[-3000:])
        deadline = time.monotonic() + 240
        while _health(server)["status"] != "ok" and time.monotonic() < deadline:
            time.sleep(0.5)
        back = time.monotonic() - killed
        assert _health(server)["status"] == "ok", server.text()
        print(f"\none replica's rank killed: /health ok again {back:.1f} s later")
        m = server.metrics()
        assert sum(v for k, v in m.items() if k.startswith("atoll_router_replica_restarts_total")) == 1
        assert all(v == 1 for k, v in m.items() if k.startswith("atoll_router_replica_up"))
        new_ranks = server.rank_pids()
        assert len(new_ranks) == 2 and ranks[0] not in new_ranks and ranks[1] in new_ranks

        async def again():  # both replicas serve: round robin sends one to each
            c = client()
            return await asyncio.gather(*[_stream(c, p, GREEDY, asyncio.Event()) for p in prompts[:4]])

        assert [ids for ids, _ in asyncio.run(again())] == expected[:4]
    finally:
        server.kill()


@pytest.mark.timeout(300)
def test_restart_policy_flags_are_checked(tiny_model, tmp_path):
    d = with_tokenizer(tiny_model("llama"), tmp_path / "m")
    out = subprocess.run([sys.executable, "-m", "atoll", "serve", "--model", str(d), "--port", "0", "-dp", "2",
                          "--max-restarts", "-1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--max-restarts -1 must be a whole number of at least 0" in out.stderr, out.stderr
