"""A disaggregated 1P1D server heals (issue 37) under --restart-policy on-failure, through the
real openai client: the prefill engine's rank killed while requests are in it or their KV is on
its way, or the decode engine's rank killed mid-stream. Every stream finishes with
transformers' tokens and no error event (the job is started again and the requests continue
there with the tokens they streamed), and /health is ok again (serve.replica_start.start_disagg)."""

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
NEW = 96
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
PROMPTS = [[(11 * i + 7 * j) % 290 + 5 for j in range(12 + 3 * i)] for i in range(6)]  # each to the prefill engine


async def _stream(c, prompt, got_one: asyncio.Event):
    ids = []
    try:
        async for chunk in await c.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, stream=True,
                                                      **GREEDY):
            if chunk.choices:
                ids += chunk.choices[0].token_ids
            if ids:
                got_one.set()
    except openai.APIError as e:
        return ids, str(e)
    return ids, None


def _healed(tiny_model, tmp_path, victim: int):
    """Three streams running, three more just sent, then job rank `victim` (0: the prefill
    engine, 1: the decode engine) killed."""
    d = with_tokenizer(tiny_model("llama", max_position_embeddings=512), tmp_path / "m")
    expected = reference_tokens(d, PROMPTS, NEW)
    server = Server(d, "--prefill", "TP1", "--decode", "TP1", "--disagg-min-prompt-tokens", 1,
                    "--served-model-name", NAME, log=tmp_path / "server.log")
    try:
        ranks = server.rank_pids()
        assert len(ranks) == 2

        async def go():
            c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
            events = [asyncio.Event() for _ in PROMPTS]
            tasks = [asyncio.create_task(_stream(c, p, e)) for p, e in zip(PROMPTS[:3], events)]
            await asyncio.wait_for(asyncio.gather(*[e.wait() for e in events[:3]]), 240)
            tasks += [asyncio.create_task(_stream(c, p, e)) for p, e in zip(PROMPTS[3:], events[3:])]
            await asyncio.sleep(0.05)  # sent: in the prefill engine or on their way to the decode engine
            os.kill(ranks[victim], signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 400), time.monotonic()

        results, killed = asyncio.run(go())
        errors = [e for _, e in results if e is not None]
        assert not errors, (errors, server.text()[-3000:])
        assert [ids for ids, _ in results] == expected
        deadline = time.monotonic() + 240
        while httpx.get(f"{server.url}/health", timeout=10).json()["status"] != "ok" and time.monotonic() < deadline:
            time.sleep(0.5)
        assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok", server.text()[-3000:]
        print(f"\njob rank {victim} killed: /health ok {time.monotonic() - killed:.1f} s after the streams ended")
        m = server.metrics()
        assert sum(v for k, v in m.items() if k.startswith("atoll_router_replica_restarts_total")) == 1
        assert m["atoll_router_migrations_total"] >= 1
        assert ranks[victim] not in server.rank_pids() and len(server.rank_pids()) == 2  # the job started again

        async def again():
            c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
            return await _stream(c, PROMPTS[0], asyncio.Event())

        assert asyncio.run(again()) == (expected[0], None)  # it serves again
    finally:
        server.kill()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_prefill_engine_killed_during_transfers_loses_no_stream(tiny_model, tmp_path):
    _healed(tiny_model, tmp_path, 0)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_decode_engine_killed_mid_stream_loses_no_stream(tiny_model, tmp_path):
    _healed(tiny_model, tmp_path, 1)
