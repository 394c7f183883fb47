"""`atoll serve` when things go wrong, each on a server of its own: a rank killed mid-stream
under --restart-policy never (the streams end with an error naming it, /health says 503, the
process exits with one line; on-failure, the default, restarts it: test_serve_restart.py)
and SIGTERM (no new connections, a short stream finishes, one past --shutdown-timeout ends
with an error, exit 0)."""

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest
from serving import Server, with_tokenizer

NAME = "tiny"
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})


def client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


async def _stream(c, max_tokens: int, started: asyncio.Event | None = None):
    """(token ids, the error that ended the stream or None)."""
    ids = []
    try:
        async for chunk in await c.completions.create(model=NAME, prompt=[5, 7, 9], max_tokens=max_tokens,
                                                      stream=True, **GREEDY):
            ids += chunk.choices[0].token_ids
            if started is not None and ids:
                started.set()
    except openai.APIError as e:
        return ids, e
    return ids, None


@pytest.mark.timeout(300)
def test_a_killed_rank_fails_requests_naming_it_and_the_server_exits(tiny_model, tmp_path):
    d = with_tokenizer(tiny_model("llama"), tmp_path / "m")
    server = Server(d, "-tp", "2", "--served-model-name", NAME, "--restart-policy", "never",
                    log=tmp_path / "server.log")
    try:
        ranks = server.rank_pids()
        assert len(ranks) == 2

        async def go():
            c = client(server)
            started = [asyncio.Event(), asyncio.Event()]
            streams = [asyncio.create_task(_stream(c, 250, e)) for e in started]
            await asyncio.wait_for(asyncio.gather(*[e.wait() for e in started]), 60)
            os.kill(ranks[1], signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*streams), 60)
            async with httpx.AsyncClient() as http:
                health = await http.get(f"{server.url}/health", timeout=10)
            return results, health

        results, health = asyncio.run(go())
        for ids, error in results:
            assert error is not None and "rank 1" in str(error) and len(ids) < 250, (ids, error)
        assert health.status_code == 503 and "rank 1" in health.json()["error"]
        assert server.wait(60) == 2
        out = server.text()
        lines = [line for line in out.splitlines() if line.startswith("atoll: error:")]
        assert len(lines) == 1 and "rank 1" in lines[0] and "Traceback" not in out, out
    finally:
        server.kill()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_drains_then_exits_0(tiny_model, tmp_path):
    d = with_tokenizer(tiny_model("llama", max_position_embeddings=4096), tmp_path / "m")
    timeout_s = 4
    server = Server(d, "--served-model-name", NAME, "--shutdown-timeout", timeout_s, "--max-num-seqs", 4,
                    log=tmp_path / "server.log")
    try:
        async def go():
            c = client(server)
            started = asyncio.Event()
            long = asyncio.create_task(_stream(c, 4000, started))  # far past the shutdown timeout
            await asyncio.wait_for(started.wait(), 60)
            short = asyncio.create_task(_stream(c, 8))
            await asyncio.sleep(0.2)  # the short one is in the server
            os.kill(server.pid, signal.SIGTERM)
            sent = time.monotonic()
            await asyncio.sleep(0.5)
            with pytest.raises(httpx.TransportError):  # new connections are refused
                async with httpx.AsyncClient() as http:
                    await http.get(f"{server.url}/health", timeout=5)
            return await asyncio.wait_for(short, 60), await asyncio.wait_for(long, 60), time.monotonic() - sent

        (short_ids, short_err), (long_ids, long_err), waited = asyncio.run(go())
        assert short_err is None and len(short_ids) == 8
        assert long_err is not None and "shut down before this request finished" in str(long_err)
        assert 0 < len(long_ids) < 4000 and waited < timeout_s + 10
        assert server.wait(30) == 0
        out = server.text()
        assert "SIGTERM: draining" in out and "atoll: shut down" in out and "Traceback" not in out, out
    finally:
        server.kill()
