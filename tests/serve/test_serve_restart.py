"""A single engine that comes back (issue 37), through the real openai client: one rank of a
TP2 engine killed with SIGKILL while greedy streams run. The server stays up, starts the
engine's ranks again, and every stream finishes with transformers' tokens and no error event
(held meanwhile, then continued with the tokens it had: serve.replica_start.start_single);
/health says 503 "restarting", then ok. And a crash loop, caused on purpose with
--fault-injection, ends the server with one line naming the engine and the last cause."""

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
NEW = 400
STREAMS = 6
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})


def _prompts(n: int) -> list[list[int]]:
    return [[(13 * i + 7 * j) % 290 + 3 for j in range(4 + i % 5)] for i in range(n)]


async def _stream(c, prompt, started: asyncio.Event, gaps: list | None = None):
    """(token ids, the error event that ended the stream or None); gaps gets the longest wait
    between two of its chunks."""
    ids, last, gap = [], None, 0.0
    try:
        async for chunk in await c.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, stream=True,
                                                      **GREEDY):
            ids += chunk.choices[0].token_ids
            now = time.monotonic()
            gap, last = max(gap, now - last) if last is not None and ids else gap, now
            if ids:
                started.set()
        if gaps is not None:
            gaps.append(gap)
    except openai.APIError as e:
        return ids, str(e)
    return ids, None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_rank_of_one_engine_is_restarted_and_every_stream_finishes(tiny_model, tmp_path):
    d = with_tokenizer(tiny_model("llama", max_position_embeddings=512), tmp_path / "m")
    prompts = _prompts(STREAMS)
    expected = reference_tokens(d, prompts, NEW)
    server = Server(d, "-tp", "2", "--max-num-seqs", "8", "--served-model-name", NAME, log=tmp_path / "server.log")
    try:
        ranks = server.rank_pids()
        assert len(ranks) == 2
        seen: list = []  # /health's answers from the kill on: (time, status code, status)
        gaps: list = []  # each stream's longest wait between two chunks

        async def go():
            c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
            events = [asyncio.Event() for _ in prompts]
            tasks = [asyncio.create_task(_stream(c, p, e, gaps)) for p, e in zip(prompts, events)]
            await asyncio.wait_for(asyncio.gather(*[e.wait() for e in events]), 240)  # every one streaming
            os.kill(ranks[1], signal.SIGKILL)
            killed = time.monotonic()
            async with httpx.AsyncClient() as http:
                while not all(t.done() for t in tasks):
                    r = await http.get(f"{server.url}/health", timeout=10)
                    seen.append((time.monotonic(), r.status_code, r.json()["status"]))
                    await asyncio.sleep(0.1)
            return await asyncio.wait_for(asyncio.gather(*tasks), 300), killed

        results, killed = asyncio.run(go())
        ended = time.monotonic()
        errors = [e for _, e in results if e is not None]
        assert not errors, (errors, server.text()[-3000:])
        assert [ids for ids, _ in results] == expected  # nothing repeated or missing: transformers' tokens
        down = [t for t, code, status in seen if (code, status) == (503, "restarting")]
        assert down, seen  # the engine was down and said so
        ok = [t for t, code, status in seen if (code, status) == (200, "ok") and t > down[-1]]
        assert ok or httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"
        assert len(gaps) == STREAMS
        print(f"\nrank 1 of a TP2 engine killed: /health 'restarting' from {down[0] - killed:.1f} s to "
              f"{down[-1] - killed:.1f} s after the kill; each stream's longest gap (the outage a client saw) "
              f"{min(gaps):.1f}-{max(gaps):.1f} s; the streams ended {ended - killed:.1f} s after the kill")
        new_ranks = server.rank_pids()
        assert len(new_ranks) == 2 and not set(ranks) & set(new_ranks)  # both ranks started again
        m = server.metrics()
        assert m['atoll_router_replica_restarts_total{replica="0"}'] == 1
        assert m["atoll_router_migrations_total"] >= 1  # streams went on with their tokens

        async def again():  # the restarted engine serves new requests
            c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
            return await asyncio.gather(*[_stream(c, p, asyncio.Event()) for p in prompts[:2]])

        assert [ids for ids, _ in asyncio.run(again())] == expected[:2]
    finally:
        server.kill()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_crash_loop_ends_the_server_in_one_line(tiny_model, tmp_path):
    """Rank 1 kills itself at its 3rd step on every start: the request streams, is held through
    each restart, and once --max-restarts is spent it ends with the cause and the server exits 2."""
    d = with_tokenizer(tiny_model("llama", max_position_embeddings=512), tmp_path / "m")
    server = Server(d, "-tp", "2", "--served-model-name", NAME, "--max-restarts", "1",
                    "--fault-injection", "kill:rank=1:step=3", log=tmp_path / "server.log")
    try:
        async def go():
            c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
            return await _stream(c, [5, 7, 9], asyncio.Event())

        ids, error = asyncio.run(go())
        assert error is not None and "crash loop: 1 restarts within 600 s" in error, (ids, error)
        assert 0 < len(ids) < NEW
        assert server.wait(120) == 2
        out = server.text()
        lines = [line for line in out.splitlines() if line.startswith("atoll: error:")]
        assert len(lines) == 1, out
        assert "engine TP2" in lines[0] and "last cause: rank 1" in lines[0] and "SIGKILL" in lines[0], lines
        assert "Traceback" not in out, out
    finally:
        server.kill()
