"""`atoll serve --elastic-ep` through the real openai client: a DP3EP3 engine of CPU ranks (tiny
Qwen3-MoE, one redundant expert) loses rank 2, or rank 0, to --fault-injection kill while streams
run on every replica. Every stream finishes with transformers' tokens and text, none repeated or lost
(the lost rank's requests continue from the tokens their clients had seen), /health says
degraded at DP2EP2 with a 200 (not down), and a request sent afterwards is served."""

import asyncio

import httpx
import openai
import pytest
from cli import run_cli
from reference import reference_tokens
from serving import Server, text_of, with_tokenizer

NAME = "tiny"
NEW = 40
PROMPTS = [[(13 * i + 7 * j) % 290 + 8 for j in range(3 + i % 5)] for i in range(6)]
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})


async def _stream(c, prompt):
    """(token ids, text, error)"""
    ids, text = [], ""
    try:
        async for chunk in await c.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, stream=True,
                                                      **GREEDY):
            ids += chunk.choices[0].token_ids
            text += chunk.choices[0].text
    except openai.APIError as e:
        return ids, text, str(e)
    return ids, text, None


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("victim", [2, 0])
def test_a_killed_ep_rank_leaves_the_server_degraded_and_every_stream_whole(tiny_model, tmp_path, victim):
    """victim 0: the engine's first rank, the one that talked to the server; a new one takes over."""
    d = with_tokenizer(tiny_model("qwen3_moe", num_experts=8), tmp_path / "m")
    expected = reference_tokens(d, PROMPTS, NEW)
    server = Server(d, "--layout", "DP3EP3", "--enable-eplb", "--num-redundant-experts", "1",
                    "--eplb-step-interval", "10000", "--elastic-ep", "--max-model-len", "128",
                    "--served-model-name", NAME, "--fault-injection", f"kill:rank={victim}:step=8",
                    log=tmp_path / "server.log", env={"ATOLL_COLLECTIVE_TIMEOUT_S": "20", "OMP_NUM_THREADS": "1"})
    try:
        assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}

        async def go():
            c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
            return await asyncio.gather(*[_stream(c, p) for p in PROMPTS])

        got = asyncio.run(go())
        assert [g[2] for g in got] == [None] * len(PROMPTS), server.text()
        assert [g[0] for g in got] == expected
        assert [g[1].strip() for g in got] == [text_of(e) for e in expected]
        assert f"rank {victim} lost (killed by SIGKILL)" in server.text()
        assert f"serving again at DP2EP2 without rank(s) [{victim}]" in server.text()
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 200
        assert health.json() == {"status": "degraded",
                                 "dead": {str(victim): "killed by SIGKILL; the engine serves on at DP2EP2"}}
        after = asyncio.run(_after(server.url))
        assert after == (expected[0], None)
    finally:
        server.kill()
        server.wait(30)


async def _after(url):
    c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    ids, _, err = await _stream(c, PROMPTS[0])
    return ids, err


@pytest.mark.parametrize("flags,error", [
    (["--enable-admin-api"], "--elastic-ep runs one engine that shrinks itself: --enable-admin-api has no replicas"),
])
def test_serve_refuses_elastic_ep_where_it_cannot_run(tiny_model, capsys, flags, error):
    model_dir = tiny_model("qwen3_moe", num_experts=8)
    code, out, err = run_cli(capsys, "serve", "--model", model_dir, "--layout", "DP3EP3", "--enable-eplb",
                             "--num-redundant-experts", "1", "--elastic-ep", *flags)
    assert code == 2 and out == ""
    assert err.startswith(f"atoll: error: {error}") and err.count("\n") == 1, err
