"""`atoll bench serve`'s load: the requests (random token ids or a JSONL of prompts), their
arrival times (vLLM's: gamma-distributed gaps of shape `burstiness` and mean 1/rate, so 1 is
Poisson; rate inf sends them all at once), and the streaming client that times each one
against an OpenAI-compatible /v1/completions (httpx, imported by the functions that send).

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
import random
import time
from dataclasses import dataclass
from pathlib import Path

from atoll.bench.serve_report import RequestResult
from atoll.errors import ConfigError, InputError, LaunchError


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int] | str  # token ids, or text
    output_len: int  # max_tokens (and min_tokens with ignore_eos)

    @property
    def prompt_len(self) -> int | None:
        """Tokens sent, when the prompt is token ids."""
        return len(self.prompt) if isinstance(self.prompt, list) else None


def random_requests(n: int, *, input_len: int, output_len: int, vocab_size: int, seed: int = 0,
                    range_ratio: float = 0.0) -> list[BenchRequest]:
    """n prompts of uniformly random token ids; with range_ratio r, each length is drawn
    uniformly from [len * (1 - r), len * (1 + r)] (vLLM's --random-range-ratio), at least 1."""
    if not 0 <= range_ratio < 1:
        raise ConfigError(f"--range-ratio {range_ratio}: must be in [0, 1)")
    rng = random.Random(seed)

    def length(mean: int) -> int:
        lo, hi = max(1, math.floor(mean * (1 - range_ratio))), max(1, math.ceil(mean * (1 + range_ratio)))
        return rng.randint(lo, hi)

    out = []
    for _ in range(n):
        isl, osl = length(input_len), length(output_len)
        out.append(BenchRequest([rng.randrange(vocab_size) for _ in range(isl)], osl))
    return out


def jsonl_requests(path: str, n: int, *, output_len: int) -> list[BenchRequest]:
    """The first n lines of a JSONL file, each {"prompt": text or token ids} with an optional
    "output_len" (or "max_tokens"); fewer lines than n are cycled."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"--dataset {path}: no such file")
    rows = []
    for ln, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{ln}: not JSON ({e.msg})") from None
        prompt = row.get("prompt") if isinstance(row, dict) else None
        ok_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not ok_ids:
            raise InputError(f"{path}:{ln}: needs \"prompt\": a non-empty text or list of token ids")
        osl = row.get("output_len", row.get("max_tokens", output_len))
        if isinstance(osl, bool) or not isinstance(osl, int) or osl < 1:
            raise InputError(f"{path}:{ln}: output_len={osl!r} must be a whole number of at least 1")
        rows.append(BenchRequest(prompt, osl))
    if not rows:
        raise InputError(f"--dataset {path}: no prompts")
    return [rows[i % len(rows)] for i in range(n)]


def arrival_times(n: int, *, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the start at which each of n requests is sent: 0 for the first, then gaps
    drawn from a gamma distribution of shape `burstiness` and scale 1 / (rate * burstiness)
    (mean 1 / rate; burstiness 1 is a Poisson process, lower is burstier); all 0 at rate inf."""
    if not rate > 0:
        raise ConfigError(f"--request-rate {rate}: must be positive (inf: all at once)")
    if not 0 < burstiness < math.inf:
        raise ConfigError(f"--burstiness {burstiness}: must be a positive number")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, theta)
    return out


def payload(model: str, req: BenchRequest, *, ignore_eos: bool = True) -> dict:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    if ignore_eos:
        body |= {"ignore_eos": True, "min_tokens": req.output_len}
    return body


async def send(client, url: str, body: dict, *, prompt_len: int | None = None, on_chunk=None) -> RequestResult:
    """One streamed completion, timed (vLLM's request function): TTFT at the first chunk that
    carries choices, each later such chunk adds a gap to ITL, E2EL at the last one; the token
    counts from the final usage chunk, else the tokens sent and the token ids the chunks carried
    (or the chunks, where they carry none).
    on_chunk(k): after the k-th chunk (1-based)."""
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
                    ids += len(msg["choices"][0].get("token_ids") or ())
                    if chunks == 0:
                        r.ttft = now - st
                    else:
                        r.itl.append(now - last)
                    last = now
                    chunks += 1
                    if on_chunk is not None:
                        on_chunk(chunks)
                usage = msg.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    r.output_tokens = int(usage["completion_tokens"])
                    r.prompt_tokens = int(usage.get("prompt_tokens") or r.prompt_tokens)
                    r.usage = True
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
