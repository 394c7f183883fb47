"""`atoll bench serve`'s client: the streaming client that times each request (built by
planner/sim/load.py, which the simulator replays too) against an OpenAI-compatible
/v1/completions (httpx, imported by the functions that send), each sent at its arrival time.

A request is sent as vLLM's benchmark sends it: `prompt` is the token ids (the OpenAI API takes
an int array) or the text, `stream` with `stream_options.include_usage` so the last chunk
carries the server's token counts, greedy, and by default `ignore_eos` with `min_tokens` equal to
`max_tokens` so every request generates exactly its output length. It also asks for
`return_token_ids` (vLLM's and atoll's extension): a chunk then comes with every new token even
where its text is held back (an incomplete UTF-8 character, or a model without a tokenizer),
so each step the server streams is a chunk the ITL counts.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

from atoll.errors import LaunchError
from atoll.planner.sim.load import BenchRequest, arrival_times
from atoll.planner.sim.report import RequestResult


def payload(model: str, req: BenchRequest, *, ignore_eos: bool = True) -> dict:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    if ignore_eos:
        body |= {"ignore_eos": True, "min_tokens": req.output_len}
    return body


async def send(client, url: str, body: dict, *, prompt_len: int | None = None, on_chunk=None,
               token_ids: list | None = None, usage: dict | None = None) -> RequestResult:
    """One streamed completion, timed (vLLM's request function): TTFT at the first chunk that
    carries choices, each later such chunk adds a gap to ITL, E2EL at the last one; the token
    counts from the final usage chunk, else the tokens sent and the token ids the chunks carried
    (or the chunks, where they carry none).
    on_chunk(k): after the k-th chunk (1-based). token_ids: a list that takes the ids the chunks carry;
    usage: a dict that takes the final usage chunk's fields (cached tokens among them)."""
    r = RequestResult(prompt_tokens=prompt_len or 0)
    chunks = ids = 0
    st = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                r.error = f"HTTP {resp.status_code}: {' '.join(text.split())[:300]}"
                return r
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("error"):
                    r.error = f"stream error: {str(msg['error'])[:300]}"
                    return r
                if msg.get("choices"):
                    now = time.perf_counter()
                    got = msg["choices"][0].get("token_ids") or ()
                    ids += len(got)
                    if token_ids is not None:
                        token_ids.extend(got)
                    if chunks == 0:
                        r.ttft = now - st
                    else:
                        r.itl.append(now - last)
                    last = now
                    chunks += 1
                    if on_chunk is not None:
                        on_chunk(chunks)
                got_usage = msg.get("usage")
                if got_usage and got_usage.get("completion_tokens") is not None:
                    r.output_tokens = int(got_usage["completion_tokens"])
                    r.prompt_tokens = int(got_usage.get("prompt_tokens") or r.prompt_tokens)
                    r.usage = True
                    if usage is not None:
                        usage.update(got_usage)
    except Exception as e:  # noqa: BLE001 -- a failed request is a result, named by its error
        r.error = f"{type(e).__name__}: {e}"[:300]
        return r
    if chunks == 0:
        r.error = "the stream carried no tokens"
        return r
    r.latency = last - st
    if not r.usage:
        r.output_tokens = ids or chunks
    r.success = True
    return r


async def run_load(url: str, model: str, requests: list[BenchRequest], *, rate: float = math.inf,
                   burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
                   ignore_eos: bool = True, timeout_s: float = 600.0) -> tuple[list[RequestResult], float]:
    """Every request sent at its arrival time (waiting for a free slot under max_concurrency,
    vLLM's semaphore: rate inf with it is a closed loop); (results in order, seconds from the
    first send to the last response). The whole run is bounded by timeout_s: a request still
    running then fails as timed out."""
    # lazy: httpx is the optional atoll[serve]; atoll simulate imports this module without it
    import httpx

    endpoint = url.rstrip("/") + "/v1/completions"
    times = arrival_times(len(requests), rate=rate, burstiness=burstiness, seed=seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max(max_concurrency or len(requests), 1), max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits) as client:
        t0 = time.perf_counter()
        deadline = t0 + timeout_s

        async def one(at: float, req: BenchRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            start = time.perf_counter()
            try:
                if sem is None:
                    res = await asyncio.wait_for(_timed(client, endpoint, model, req, ignore_eos), deadline - start)
                else:
                    async with sem:
                        start = time.perf_counter()
                        res = await asyncio.wait_for(_timed(client, endpoint, model, req, ignore_eos),
                                                     deadline - start)
            except (asyncio.TimeoutError, ValueError):
                res = RequestResult(prompt_tokens=req.prompt_len or 0, error=f"timed out after {timeout_s:g} s")
            res.start = start - t0
            return res

        results = await asyncio.gather(*(one(at, req) for at, req in zip(times, requests)))
        return list(results), time.perf_counter() - t0


def _timed(client, endpoint: str, model: str, req: BenchRequest, ignore_eos: bool):
    return send(client, endpoint, payload(model, req, ignore_eos=ignore_eos), prompt_len=req.prompt_len)


def served_model(url: str, fallback: str, *, timeout_s: float = 10.0) -> str:
    """The first model id the server lists at /v1/models, else fallback."""
    # lazy: httpx is the optional atoll[serve]; atoll simulate imports this module without it
    import httpx

    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", timeout=timeout_s)
        data = r.json().get("data") or []
        return str(data[0]["id"]) if r.status_code == 200 and data else fallback
    except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError):
        return fallback


def warm_up(url: str, model: str, requests, args) -> None:
    """The requests sent at once, untimed: the first steps pay for allocation and, with a
    compiled decode step, its graphs (one row, and several: two requests at least)."""
    results, _ = asyncio.run(run_load(url, model, requests, ignore_eos=args.ignore_eos, timeout_s=args.timeout))
    bad = [r.error for r in results if not r.success]
    if bad:
        raise LaunchError(f"the server failed a warm-up request: {bad[0]}")
