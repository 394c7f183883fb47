"""`atoll serve --kv-shared redis://...` on a real redis-server: a prefix computed by one replica
is served to the other replica from the store (round-robin routing sends the follow-up there),
and to a second server process; greedy tokens equal transformers', through the openai client.
/metrics counts the shared tier's hits."""

import asyncio

import openai
import pytest
from redis_server import server  # noqa: F401  (the redis-server fixture)
from reference import reference_tokens
from serving import Server, with_tokenizer

NAME = "tiny"
NEW = 6
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
SYSTEM = list(range(10, 50))  # 40 tokens: two full blocks of 16
PROMPTS = [SYSTEM + [60, 61], SYSTEM + [70, 71, 72], SYSTEM + [80]]


async def _complete(url: str, prompt: list[int]):
    c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    r = await c.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, **GREEDY)
    return r.choices[0].token_ids, r.usage.prompt_tokens_details.cached_tokens


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_replicas_and_a_second_server_share_prefixes_through_redis(tiny_model, tmp_path, server):
    url, _ = server
    d = with_tokenizer(tiny_model("llama"), tmp_path / "m")
    want = reference_tokens(d, PROMPTS, NEW)
    flags = ["--served-model-name", NAME, "--kv-shared", url]
    a = Server(d, "-dp", "2", "--router", "round_robin", *flags, log=tmp_path / "a.log")
    try:
        first = asyncio.run(_complete(a.url, PROMPTS[0]))  # replica 0 computes the system prompt
        second = asyncio.run(_complete(a.url, PROMPTS[1]))  # replica 1 has never seen it
        hits = a.metrics().get('atoll_kv_tier_hits{tier="shared"}', 0)
    finally:
        a.kill()
    b = Server(d, *flags, log=tmp_path / "b.log")  # another server process, its pool empty
    try:
        third = asyncio.run(_complete(b.url, PROMPTS[2]))
    finally:
        b.kill()
    assert [first[0], second[0], third[0]] == want
    assert (first[1], second[1], third[1]) == (0, 32, 32)
    assert hits >= 2  # the two blocks came from Redis, not from replica 1's pool
