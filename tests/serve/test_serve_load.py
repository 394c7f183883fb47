"""`atoll serve` under load, one TP1 server for the module: the prefix cache across HTTP
requests (a shared 512-token system prompt: the second request reports it cached and its
first token comes sooner), 200 concurrent streams from the async openai client (transformers'
greedy tokens, every KV block back afterwards), and 20 streams closed mid-way and a plain
request whose client gave up (aborted, their blocks freed, the server serving on)."""

import asyncio
import os
import random
import statistics
import time

import httpx
import openai
import pytest
from reference import reference_tokens
from serving import Server, text_of, with_tokenizer

NAME = "tiny"
# big enough that a 512-token prefill takes clearly longer than an HTTP round trip
MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, max_position_embeddings=1024)
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory):
    return with_tokenizer(tiny_model("llama", **MODEL), tmp_path_factory.mktemp("serve-load") / "m")


@pytest.fixture(scope="module")
def server(model_dir):
    # compiled, as a server runs by default (the suite's default is never): the step compiles before "ready"
    s = Server(model_dir, "--served-model-name", NAME, log=model_dir.parent / "server.log",
               env={"ATOLL_COMPILE": "auto"})
    try:
        yield s
    finally:
        s.kill()


def client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)


async def _chat_ttft(c, messages) -> tuple[float, int]:
    """(client-side time to the first token, cached prompt tokens) of one streamed chat."""
    start = time.perf_counter()
    first, cached = None, None
    async for chunk in await c.chat.completions.create(model=NAME, messages=messages, max_tokens=2, stream=True,
                                                       stream_options={"include_usage": True}, **GREEDY):
        if chunk.choices and chunk.choices[0].token_ids and first is None:
            first = time.perf_counter() - start
        if chunk.usage:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return first, cached


@pytest.mark.timeout(300)
def test_a_shared_system_prompt_is_cached_across_requests(server):
    rng = random.Random(0)

    async def go():
        c = client(server)
        await _chat_ttft(c, [{"role": "user", "content": "w9 w10"}])  # warm the path
        cold, warm = [], []
        for _ in range(5):  # each round its own 512-token system prompt: cold, then warm
            system = " ".join(f"w{rng.randrange(7, 301)}" for _ in range(512))
            cold.append(await _chat_ttft(c, [{"role": "system", "content": system},
                                              {"role": "user", "content": "w11 w12 w13"}]))
            warm.append(await _chat_ttft(c, [{"role": "system", "content": system},
                                              {"role": "user", "content": "w21 w22"}]))
        return cold, warm

    cold, warm = asyncio.run(go())
    print(f"\nTTFT with a 512-token system prompt, cold then warm (s): {[round(t, 4) for t, _ in cold]} "
          f"{[round(t, 4) for t, _ in warm]}; load average {os.getloadavg()[0]:.2f}")
    assert all(cached < 512 for _, cached in cold) and all(cached >= 512 for _, cached in warm)
    assert statistics.median(t for t, _ in warm) < statistics.median(t for t, _ in cold)


def test_the_decode_step_is_compiled_before_the_server_says_it_is_ready(server):
    """The first request does not wait for a compile: the ranks compile before "ready"."""
    log = server.text()
    assert "compiled the decode step" in log, log
    assert log.index("compiled the decode step") < log.index(f"serving {NAME} on"), log


@pytest.mark.timeout(120)
def test_a_kept_alive_connection_answers_without_waiting_for_a_delayed_ack(server):
    """With Nagle's algorithm on the server's sockets, a response's body waited for the client's
    delayed ACK of its headers: every request after the first on a connection took ~40 ms."""
    with httpx.Client(base_url=server.url, timeout=30) as c:
        c.get("/health")
        times = []
        for _ in range(10):
            start = time.perf_counter()
            assert c.get("/health").status_code == 200
            times.append(time.perf_counter() - start)
    print(f"\n/health on one connection (ms): {[round(t * 1000, 1) for t in times]}; "
          f"load average {os.getloadavg()[0]:.2f}")
    assert statistics.median(times) < 0.02


@pytest.mark.timeout(600)
def test_200_concurrent_streams_match_offline_and_free_every_block(server, model_dir):
    rng = random.Random(1)
    distinct = [[rng.randrange(301) for _ in range(rng.randrange(3, 12))] for _ in range(40)]
    new = 6
    reference = reference_tokens(model_dir, distinct, new)  # transformers one token at a time: 40, not 200
    prompts, expected = distinct * 5, reference * 5

    async def one(c, prompt):
        ids, text = [], ""
        async for chunk in await c.completions.create(model=NAME, prompt=prompt, max_tokens=new, stream=True,
                                                      **GREEDY):
            ids += chunk.choices[0].token_ids
            text += chunk.choices[0].text
        return ids, text

    async def go():
        c = client(server)
        return await asyncio.wait_for(asyncio.gather(*[one(c, p) for p in prompts]), 400)

    start = time.perf_counter()
    got = asyncio.run(go())
    print(f"\n200 streams in {time.perf_counter() - start:.1f} s; load average {os.getloadavg()[0]:.2f}")
    assert [ids for ids, _ in got] == expected
    assert [text for _, text in got] == [text_of(e) for e in expected]
    assert server.wait_metric("atoll_kv_blocks_in_use", 0.0) == 0.0
    assert server.wait_metric("atoll_num_requests_running", 0.0) == 0.0


@pytest.mark.timeout(300)
def test_closed_streams_are_aborted_and_free_their_blocks(server, model_dir):
    before = server.metrics()
    prompts = [[7 + k, 100, 200 + k] for k in range(20)]

    async def read_a_little(c, prompt):
        stream = await c.completions.create(model=NAME, prompt=prompt, max_tokens=500, stream=True, **GREEDY)
        got = 0
        async for chunk in stream:
            got += len(chunk.choices[0].token_ids)
            if got >= 2:
                break
        await stream.close()  # the connection goes: the server must abort the request
        return got

    async def give_up(prompt):  # not streamed: the client times out and closes the connection
        async with httpx.AsyncClient() as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post(f"{server.url}/v1/completions", json={"model": NAME, "prompt": prompt,
                                                                      "max_tokens": 500, "ignore_eos": True},
                                timeout=httpx.Timeout(30, read=1.0))

    async def go():
        c = client(server)
        await asyncio.wait_for(asyncio.gather(*[read_a_little(c, p) for p in prompts], give_up([9, 9, 9])), 120)

    asyncio.run(go())
    aborted = 'atoll_requests_finished_total{finish_reason="abort"}'
    assert server.wait_metric(aborted, before[aborted] + 21) == before[aborted] + 21
    assert server.wait_metric("atoll_kv_blocks_in_use", 0.0) == 0.0
    after = server.metrics()
    generated = after["atoll_generation_tokens_total"] - before["atoll_generation_tokens_total"]
    assert generated < 21 * 500 / 2  # they stopped early, far from their 500 tokens

    async def again():
        r = await client(server).completions.create(model=NAME, prompt=[5, 7, 9], max_tokens=4, **GREEDY)
        return r.choices[0].token_ids

    assert asyncio.run(again()) == reference_tokens(model_dir, [[5, 7, 9]], 4)[0]


def test_plan_reads_the_servers_metrics_for_its_correction(server):
    """atoll plan --from-metrics (planner/sim/observed.py) reads this server's own /metrics: its
    means are the histograms' sums over counts, and its lengths the token counters per request."""
    from atoll.errors import ConfigError
    from atoll.planner.sim.observed import read_metrics

    m = server.metrics()
    if m.get("atoll_e2e_request_latency_seconds_count", 0) < 10:  # run alone: make the traffic it reads
        for i in range(12):
            httpx.post(f"{server.url}/v1/completions", json={"model": NAME, "prompt": [7 + i, 8, 9], "max_tokens": 4,
                                                             "ignore_eos": True}, timeout=120).raise_for_status()
        m = server.metrics()
    seen = read_metrics(server.url)
    done = m["atoll_e2e_request_latency_seconds_count"]
    assert seen.requests == int(done) >= 10
    assert seen.ttft_s == pytest.approx(m["atoll_time_to_first_token_seconds_sum"]
                                        / m["atoll_time_to_first_token_seconds_count"])
    assert seen.itl_s == pytest.approx(m["atoll_inter_token_latency_seconds_sum"]
                                       / m["atoll_inter_token_latency_seconds_count"])
    assert seen.osl == pytest.approx(m["atoll_generation_tokens_total"] / done)
    assert seen.isl == pytest.approx(m["atoll_prompt_tokens_total"] / done) and seen.isl > 0
    with pytest.raises(ConfigError, match="HTTP 404"):
        read_metrics(f"{server.url}/v1/nothing")
