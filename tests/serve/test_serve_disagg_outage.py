"""What a dead decode engine costs a disaggregated 1P2D server's streams, under each restart
policy, side by side (issue 37): two greedy streams, one on each decode engine, decode engine
1's rank killed mid-stream. Under `never` its stream moves with its tokens to decode engine 0
at once (the others go on: /health degraded); under `on-failure` the whole job is started
again and both streams continue there (/health ok once it is ready). Both end with transformers'
tokens and no error; the figures are printed (pytest -s): the kill to the moved stream's next
token, and to /health's answer."""

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
NEW = 200  # the tiny model's context is 256
PROMPTS = [[5, 7, 9, 11, 13], [100, 3]]  # under --disagg-min-prompt-tokens: on the decode engines
STEP_DELAY = "delay:rank=0:ms=15"  # every engine's steps (each TP1): the streams last seconds
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})


async def _stream(c, prompt, times: list, ids: list):
    try:
        async for chunk in await c.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, stream=True,
                                                      **GREEDY):
            if chunk.choices and chunk.choices[0].token_ids:
                ids += chunk.choices[0].token_ids
                times.append(time.monotonic())
    except openai.APIError as e:
        return str(e)
    return None


async def _health_after(server, want: str, timeout_s: float) -> float | None:
    async with httpx.AsyncClient() as http:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if (await http.get(f"{server.url}/health", timeout=10)).json().get("status") == want:
                return time.monotonic()
            await asyncio.sleep(0.05)
    return None


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("policy", ["never", "on-failure"])
def test_outage_of_a_dead_decode_engine(tiny_model, tmp_path, policy):
    d = with_tokenizer(tiny_model("llama"), tmp_path / "m")
    expected = reference_tokens(d, PROMPTS, NEW)
    server = Server(d, "--prefill", "TP1", "--decode", "TP1", "--decode-replicas", 2, "--disagg-min-prompt-tokens",
                    10, "--restart-policy", policy, "--fault-injection", STEP_DELAY, "--served-model-name", NAME,
                    log=tmp_path / "server.log")
    try:
        ranks = server.rank_pids()

        async def go():
            c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
            times, ids = [[], []], [[], []]
            runs = [asyncio.ensure_future(_stream(c, p, times[i], ids[i])) for i, p in enumerate(PROMPTS)]
            while min(map(len, ids)) < 10:
                await asyncio.sleep(0.005)
            at_kill = [len(i) for i in ids]
            killed = time.monotonic()
            os.kill(ranks[2], signal.SIGKILL)
            if policy != "never":  # first the restart shows, then ok
                await _health_after(server, "restarting", 30)
            health = await _health_after(server, "degraded" if policy == "never" else "ok", 120)
            errors = await asyncio.wait_for(asyncio.gather(*runs), 200)
            return times, ids, errors, at_kill, killed, health

        times, ids, errors, at_kill, killed, health = asyncio.run(go())
        assert errors == [None, None] and ids == expected and max(at_kill) < NEW, (errors, at_kill)
        gap = max(next(t for t in ts if t > killed) - killed for ts in times)  # the moved stream's wait
        print(f"\noutage {policy}: kill -> next token of the moved stream {gap:.2f} s; "
              f"kill -> /health {'degraded' if policy == 'never' else 'ok'} {health - killed:.2f} s; "
              f"tokens at the kill {at_kill}; load {os.getloadavg()[0]:.1f}")
        assert health is not None
        moved = server.metrics()
        if policy == "never":  # moved inside the disaggregated engine
            assert moved["atoll_disagg_migrations_total"] >= 1
        else:  # the whole job started again: the router moved them
            assert moved["atoll_router_migrations_total"] >= 1 and moved["atoll_disagg_migrations_total"] == 0
    finally:
        server.kill()
