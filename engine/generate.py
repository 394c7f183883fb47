"""The generation loop every rank of a replica runs in lock step, one tick at a time: a lane's
scheduler picks the chunks of the micro-batch entering the pipeline, the runner moves every
micro-batch in flight one stage on, and when one leaves the last stage its sequences that
reached their last token take the sampled token and finished sequences free their blocks."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from atoll.engine.lanes import Lanes, MicroBatch
from atoll.engine.sampling import SamplerState, SamplingParams
from atoll.engine.scheduler import Sequence


@dataclass
class Request:
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_step: int = 0  # the step at which it joins (tests use it to model late arrivals)


def finish_reason(seq: Sequence, max_len: int, decode=None) -> str | None:
    p = seq.request.params
    if seq.output[-1] in p.stop_token_ids:
        return "stop"
    if p.stop and decode is not None:  # every rank decodes the same tokens, so all agree
        text = decode(seq.output[-64:])  # a stop string ends within the last few tokens
        if any(stop in text for stop in p.stop):
            return "stop"
    if len(seq.output) >= p.max_tokens or len(seq.tokens) >= max_len:
        return "length"
    return None


def run_requests(runner, requests: list[Request], progress=None, *, pipelined: bool = True,
                 on_finish=None, on_token=None, inbox=None) -> list[dict]:
    """Drive `runner.tick` until every request is done; one result per request, in order.
    `progress(done, tokens)` is called after each tick when given, and `on_finish(index,
    result)` as each request finishes (so a caller can write it at once). Under PP,
    `pipelined` keeps a micro-batch in every stage (see engine.lanes); False sends one at a time.
    Disaggregation (engine.disagg): `on_token(seq, started)` is called on every rank as a
    sequence takes a token, before its blocks can be freed; `inbox.poll(tick, lanes)` gives
    (sequence, started) pairs whose prompt arrived already in the cache, and `inbox.pending`
    keeps the loop going while more are to come. With an inbox the return is a dict, request
    index -> result, of `requests` and the inbox's."""
    spec = runner.spec
    depth = runner.ctx.layout.pp
    lanes = Lanes(num_blocks=runner.num_blocks, block_size=spec.engine.block_size, max_num_seqs=spec.engine.max_num_seqs,
                  max_num_batched_tokens=spec.max_num_batched_tokens, max_model_len=spec.max_model_len,
                  depth=depth, pipelined=pipelined, prefix_caching=spec.engine.enable_prefix_caching)
    arrivals = deque(sorted(requests, key=lambda r: (r.arrival_step, r.index)))
    inflight: deque[MicroBatch | None] = deque()  # inflight[s]: the micro-batch at stage s
    results: dict[int, dict] = {}
    tick, produced, started = 0, 0, {}
    decode = _decoder(spec.model_dir) if any(r.params.stop for r in requests) else None
    runner.start_run()
    while True:
        while arrivals and arrivals[0].arrival_step <= tick:
            req = arrivals.popleft()
            lanes.add(Sequence(req, SamplerState(req.params, runner.device), arrived_step=tick))
            started[req.index] = time.perf_counter()
        if inbox is not None:
            for seq, at in inbox.poll(tick, lanes):
                started[seq.request.index] = at
                _settle(seq, lanes, results, started, spec.max_model_len, decode, tick, on_finish)
        lane = lanes.at(tick)
        chunks = lane.schedule(tick) if lane is not None else []
        mb = MicroBatch.of(chunks, spec.engine.block_size, device=runner.device) if chunks else None
        busy = bool(arrivals or lanes.has_work() or any(b is not None for b in inflight)
                    or (inbox is not None and inbox.pending))
        go, mb = runner.agree(busy, mb)
        if not go:
            break
        inflight.appendleft(mb)
        tokens = runner.tick(inflight)
        if len(inflight) == depth and (done := inflight.pop()) is not None:
            produced += _apply(done, tokens.tolist(), lanes, results, started, spec.max_model_len, decode, tick,
                               on_finish, on_token)
        tick += 1
        if progress is not None:
            progress(len(results), produced)
    runner.end_run()
    pools = [s.pool for s in lanes.schedulers]
    # every block is back once every request ended; named ones stay cached (evictable)
    runner.stats |= {"blocks_held": sum(p.num_blocks - p.num_free for p in pools),
                     "blocks_cached": sum(p.num_cached for p in pools)}
    if inbox is not None:
        return results  # index -> result
    return [results[r.index] for r in requests]


def _apply(mb: MicroBatch, tokens: list[int], lanes: Lanes, results: dict, started: dict,
           max_len: int, decode, tick: int, on_finish=None, on_token=None) -> int:
    """The micro-batch's chunks are in the cache; sampling ones take their token. Returns
    the tokens produced."""
    now, produced = time.perf_counter(), 0
    for c, token in zip(mb.chunks, tokens):
        seq = c.seq
        seq.cached = c.start + c.count
        if not c.samples:
            continue  # a prefill chunk short of the last prompt token
        seq.output.append(token)
        produced += 1
        if len(seq.output) == 1:
            seq.first_token_at = now
        if on_token is not None:
            on_token(seq, started[seq.request.index])
        _settle(seq, lanes, results, started, max_len, decode, tick, on_finish)
    return produced


def _settle(seq: Sequence, lanes: Lanes, results: dict, started: dict, max_len: int, decode, tick: int,
            on_finish=None) -> None:
    """End the sequence if its last token finishes it."""
    reason = finish_reason(seq, max_len, decode)
    if reason is not None:
        lanes.finish(seq)
        results[seq.request.index] = _result(seq, reason, started[seq.request.index], time.perf_counter(), tick)
        if on_finish is not None:
            on_finish(seq.request.index, results[seq.request.index])


def _decoder(model_dir: str):
    from atoll.engine.tokenizer import Tokenizer

    return Tokenizer(model_dir).decode


def _result(seq: Sequence, reason: str, started: float, now: float, step: int) -> dict:
    n = len(seq.output)
    first = seq.first_token_at
    return {"token_ids": seq.output, "finish_reason": reason,
            "metrics": {"ttft_s": first - started, "tpot_s": (now - first) / (n - 1) if n > 1 else 0.0,
                        "prompt_tokens": len(seq.request.prompt_token_ids), "output_tokens": n,
                        "cached_tokens": seq.cached_tokens,
                        "queued_steps": seq.first_scheduled_step - seq.arrived_step,
                        "finished_step": step, "preemptions": seq.preemptions}}
