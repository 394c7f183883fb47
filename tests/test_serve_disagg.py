"""`atoll serve --prefill TP1 --decode TP2` through the real openai client: each request's path
is decided as it arrives (short prompts, and long ones whose prefix the decode engine holds,
stay on the decode engine), greedy tokens equal transformers' on both paths, streaming and
not, /metrics counts both paths, closed streams give every block back, and a killed prefill
rank fails the requests naming its engine."""

import asyncio
import os
import signal

import httpx
import openai
import pytest
from reference import reference_tokens
from serving import Server, text_of, with_tokenizer

NAME = "tiny"
NEW = 8
MIN = 10  # --disagg-min-prompt-tokens
SHORT = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8]]  # under MIN: the decode engine
LONG = [[(11 * i + 3) % 290 + 7 for i in range(12)], [(5 * i + 1) % 290 + 7 for i in range(24)]]
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    d = with_tokenizer(tiny_model("llama", num_hidden_layers=4), tmp_path_factory.mktemp("serve-disagg") / "m")
    server = Server(d, "--prefill", "TP1", "--decode", "TP2", "--disagg-min-prompt-tokens", MIN,
                    "--served-model-name", NAME, log=d.parent / "server.log")
    try:
        yield server, reference_tokens(d, SHORT + LONG, NEW)
    finally:
        server.kill()


def client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


async def _complete(c, prompt, stream: bool, max_tokens: int = NEW):
    """(token ids, text, cached prompt tokens)."""
    if not stream:
        r = await c.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, **GREEDY)
        return r.choices[0].token_ids, r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens
    ids, text, cached = [], "", None
    async for chunk in await c.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, stream=True,
                                                  stream_options={"include_usage": True}, **GREEDY):
        if chunk.choices:
            ids += chunk.choices[0].token_ids
            text += chunk.choices[0].text
        if chunk.usage:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return ids, text, cached


def _paths(server) -> tuple[float, float]:
    m = server.metrics()
    return m.get('atoll_disagg_requests_total{path="prefill"}', 0), m.get('atoll_disagg_requests_total{path="decode"}', 0)


@pytest.mark.timeout(600)
def test_both_paths_match_transformers_and_are_counted(served):
    server, expected = served
    prompts = SHORT + LONG

    async def go():
        c = client(server)
        return await asyncio.gather(*[_complete(c, p, stream) for stream in (False, True) for p in prompts])

    before = _paths(server)
    got = asyncio.run(go())
    for (ids, text, _), want in zip(got, expected + expected):
        assert ids == want and text == text_of(want)
    prefill, decode = (a - b for a, b in zip(_paths(server), before))
    assert prefill >= len(LONG) and decode >= len(SHORT) and prefill + decode == 2 * len(prompts)


@pytest.mark.timeout(300)
def test_a_long_prompt_the_decode_engine_holds_stays_there(served):
    """The first time, a 40-token prompt goes to the prefill engine and its KV lands in the
    decode engine's prefix cache; the second time only its last 8 tokens are new (< MIN):
    the decode engine computes them, finding the rest cached."""
    server, _ = served
    prompt = [(13 * i + 2) % 290 + 7 for i in range(40)]
    want = reference_tokens_cached(server, prompt)

    async def go():
        c = client(server)
        first = await _complete(c, prompt, True)
        between = _paths(server)
        second = await _complete(c, prompt, True)
        return first, between, second

    before = _paths(server)
    first, between, second = asyncio.run(go())
    after = _paths(server)
    assert between[0] - before[0] == 1 and after[1] - between[1] == 1  # prefill engine, then decode engine
    assert first[0] == second[0] == want
    assert first[2] == 0 and second[2] == 32  # two full blocks of 16 found in the decode engine's cache


def reference_tokens_cached(server, prompt) -> list[int]:
    from pathlib import Path

    return reference_tokens(Path(server.log).parent / "m", [prompt], NEW)[0]


@pytest.mark.timeout(300)
def test_closed_streams_free_every_block_on_both_engines(served):
    server, expected = served

    async def one(c, prompt):
        stream = await c.completions.create(model=NAME, prompt=prompt, max_tokens=200, stream=True, **GREEDY)
        n = 0
        async for _ in stream:
            n += 1
            if n == 3:
                await stream.close()
                return n

    async def go():
        c = client(server)
        await asyncio.wait_for(asyncio.gather(*[one(c, p) for p in (SHORT + LONG) * 2]), 120)
        return await _complete(c, LONG[1], False)

    again = asyncio.run(go())
    assert server.wait_metric("atoll_kv_blocks_in_use", 0.0) == 0.0
    assert server.wait_metric("atoll_num_requests_running", 0.0) == 0.0
    assert again[0] == expected[-1]


@pytest.mark.timeout(300)
def test_a_killed_prefill_rank_fails_requests_naming_its_engine(tiny_model, tmp_path):
    d = with_tokenizer(tiny_model("llama"), tmp_path / "m")
    server = Server(d, "--prefill", "TP1", "--decode", "TP1", "--disagg-min-prompt-tokens", 1,
                    "--served-model-name", NAME, log=tmp_path / "server.log")
    try:
        ranks = server.rank_pids()
        assert len(ranks) == 2  # job rank 0: the prefill engine, 1: the decode engine

        async def go():
            c = client(server)
            first = await _complete(c, LONG[0], False)  # both engines up
            os.kill(ranks[0], signal.SIGKILL)
            try:
                await _complete(c, LONG[1], True, max_tokens=50)
                error = None
            except openai.APIError as e:
                error = e
            async with httpx.AsyncClient() as http:
                health = await http.get(f"{server.url}/health", timeout=10)
            return first, error, health

        first, error, health = asyncio.run(go())
        assert len(first[0]) == NEW
        assert health.status_code == 503 and "prefill engine rank 0" in health.json()["error"], health.text
        assert error is not None and ("prefill engine rank 0" in str(error) or "engine is down" in str(error))
        assert server.wait(60) == 2
        lines = [line for line in server.text().splitlines() if line.startswith("atoll: error:")]
        assert len(lines) == 1 and "prefill engine rank 0" in lines[0], server.text()
    finally:
        server.kill()
