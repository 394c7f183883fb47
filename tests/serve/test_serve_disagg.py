"""`atoll serve --prefill TP1 --decode TP2` through the real openai client: each request's path
is decided as it arrives (short prompts, and long ones whose prefix the decode engine holds,
stay on the decode engine), greedy tokens equal transformers' on both paths, streaming and
not, /metrics counts both paths, closed streams give every block back, and under
--restart-policy never a dead engine's requests go on, with their tokens, on the others (under
on-failure the job heals: test_serve_disagg_heal.py)."""

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
LAG_S = 2.0  # the driver stopped this long before a rank is killed: its channel's pipe fills
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


async def _health(server, want: str, timeout_s: float = 30.0) -> httpx.Response:
    """/health once its status is `want` (or the last answer after timeout_s)."""
    async with httpx.AsyncClient() as http:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            health = await http.get(f"{server.url}/health", timeout=10)
            if health.json().get("status") == want or asyncio.get_running_loop().time() > deadline:
                return health
            await asyncio.sleep(0.2)


@pytest.mark.timeout(300)
def test_a_dead_prefill_engine_leaves_the_decode_engine_serving(tiny_model, tmp_path):
    """1P1D: the prefill engine's rank is stopped with a long prompt queued there (no token yet),
    then killed. The queued request is sent again and prefilled by the decode engine (transformers'
    tokens); later long prompts go there too; /health says degraded, naming the prefill engine,
    and the server keeps running."""
    d = with_tokenizer(tiny_model("llama"), tmp_path / "m")
    expected = reference_tokens(d, LONG, NEW)
    server = Server(d, "--prefill", "TP1", "--decode", "TP1", "--disagg-min-prompt-tokens", 1,
                    "--restart-policy", "never", "--served-model-name", NAME, log=tmp_path / "server.log")
    try:
        ranks = server.rank_pids()
        assert len(ranks) == 2  # job rank 0: the prefill engine, 1: the decode engine

        async def go():
            c = client(server)
            first = await _complete(c, LONG[0], False)  # both engines up
            os.kill(ranks[0], signal.SIGSTOP)
            queued = asyncio.ensure_future(_complete(c, LONG[1], True))  # waits in the stopped prefill engine
            await asyncio.sleep(1.0)
            os.kill(ranks[0], signal.SIGKILL)
            os.kill(ranks[0], signal.SIGCONT)
            retried = await queued
            health = await _health(server, "degraded")
            after = await _complete(c, LONG[0], False)
            return first, retried, health, after

        first, retried, health, after = asyncio.run(go())
        assert first[0] == expected[0] and after[0] == expected[0] and retried[0] == expected[1]
        body = health.json()
        assert health.status_code == 200 and body["status"] == "degraded", health.text
        assert list(body["dead"]) == ["prefill engine"] and "prefill engine rank 0" in body["dead"]["prefill engine"]
        assert "killed by SIGKILL" in body["dead"]["prefill engine"]
        assert server.proc.poll() is None and "atoll: error:" not in server.text()
    finally:
        server.kill()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("lagging", [False, True], ids=["on-time", "driver-lagging"])
def test_a_dead_decode_engine_moves_its_streams_to_a_live_one(tiny_model, tmp_path, lagging):
    """1P2D: two long streams, one on each decode engine; decode engine 1's rank is killed. Its
    stream moves with its tokens to decode engine 0 and, like the other, finishes with
    transformers' tokens and no error; so do new requests; /health says degraded. driver-lagging: the server is
    stopped (SIGSTOP) for LAG_S around the kill, so the engines' step messages fill the pipe and
    the killed rank dies part-way through writing one (on one channel shared by the engines, the
    survivor's tokens then never came: engine/driver/channels.py)."""
    d = with_tokenizer(tiny_model("llama"), tmp_path / "m")
    long_new = 240  # the tiny model's context is 256
    expected = reference_tokens(d, SHORT[:2], long_new)
    server = Server(d, "--prefill", "TP1", "--decode", "TP1", "--decode-replicas", 2,
                    "--disagg-min-prompt-tokens", MIN, "--max-num-seqs", 1, "--restart-policy", "never",
                    "--fault-injection", "delay:rank=0:ms=20",  # 240 tokens take ~5 s: the kill finds both
                    "--served-model-name", NAME, log=tmp_path / "server.log")
    try:
        ranks = server.rank_pids()
        assert len(ranks) == 3  # job ranks: the prefill engine, decode engine 0, decode engine 1

        async def stream(c, prompt, seen: list):
            try:
                async for chunk in await c.completions.create(model=NAME, prompt=prompt, max_tokens=long_new,
                                                              stream=True, **GREEDY):
                    if chunk.choices:
                        seen += chunk.choices[0].token_ids
                return None
            except openai.APIError as e:
                return e

        async def go():
            c = client(server)
            seen = [[], []]
            runs = [asyncio.ensure_future(stream(c, SHORT[i], seen[i])) for i in range(2)]
            while min(map(len, seen)) < 5 and not any(r.done() for r in runs):  # both streaming
                await asyncio.sleep(0.01)
            at_kill = [len(s) for s in seen]
            if lagging:
                os.kill(server.proc.pid, signal.SIGSTOP)
                await asyncio.sleep(LAG_S)
            os.kill(ranks[2], signal.SIGKILL)
            if lagging:
                await asyncio.sleep(0.5)
                os.kill(server.proc.pid, signal.SIGCONT)
            errors = await asyncio.wait_for(asyncio.gather(*runs), 90)  # every stream ends, in bounded time
            health = await _health(server, "degraded")
            after = await _complete(c, SHORT[2], False)
            return seen, errors, health, after, at_kill

        seen, errors, health, after, at_kill = asyncio.run(go())
        assert max(at_kill) < long_new  # both still streaming when the rank died
        assert errors == [None, None] and seen == expected, (errors, [len(s) for s in seen])
        assert after[0] == reference_tokens(d, SHORT[2:], NEW)[0]
        body = health.json()
        assert body["status"] == "degraded" and list(body["dead"]) == ["decode engine 1"], health.text
        assert server.proc.poll() is None and "decode engine 1 rank 0" in server.text()
    finally:
        server.kill()
