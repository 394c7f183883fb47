"""The generation loop every rank of a replica runs in lock step: the scheduler picks this
step's chunks, the runner computes them, sequences that reached their last token take the
sampled token, finished sequences free their blocks."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from atoll.engine.blocks import BlockPool
from atoll.engine.sampling import SamplerState, SamplingParams, sample
from atoll.engine.scheduler import Scheduler, Sequence
from atoll.layers.attention import AttentionMetadata


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


def run_requests(runner, requests: list[Request], progress=None) -> list[dict]:
    """Drive `runner.step` until every request is done; one result per request, in order.
    `progress(done, tokens)` is called after each step when given."""
    spec = runner.spec
    pool = BlockPool(spec.num_blocks, spec.block_size)
    sched = Scheduler(pool, max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens)
    arrivals = sorted(requests, key=lambda r: (r.arrival_step, r.index))
    results: dict[int, dict] = {}
    step, produced, started = 0, 0, {}
    decode = _decoder(spec.model_dir) if any(r.params.stop for r in requests) else None
    while runner.any_work(bool(arrivals or sched.has_work())):
        while arrivals and arrivals[0].arrival_step <= step:
            req = arrivals.pop(0)
            sched.add(Sequence(req, SamplerState(req.params), arrived_step=step))
            started[req.index] = time.perf_counter()
        chunks = sched.schedule(step)
        meta = AttentionMetadata.build([c.seq.blocks for c in chunks], [c.start for c in chunks],
                                       [c.count for c in chunks], spec.block_size)
        ids = torch.tensor([t for c in chunks for t in c.seq.tokens[c.start:c.start + c.count]], dtype=torch.long)
        samplers = [c.seq.state for c in chunks]
        tokens = runner.step(ids, meta, lambda logits: sample(logits, samplers)).tolist()
        now = time.perf_counter()
        for c, token in zip(chunks, tokens):
            seq = c.seq
            seq.cached = c.start + c.count
            if not c.samples:
                continue  # a prefill chunk short of the last prompt token
            seq.output.append(token)
            produced += 1
            if len(seq.output) == 1:
                seq.first_token_at = now
            reason = finish_reason(seq, spec.max_model_len, decode)
            if reason is not None:
                sched.finish(seq)
                results[seq.request.index] = _result(seq, reason, started[seq.request.index], now, step)
        step += 1
        if progress is not None:
            progress(len(results), produced)
    return [results[r.index] for r in requests]


def _decoder(model_dir: str):
    from atoll.engine.tokenizer import Tokenizer

    return Tokenizer(model_dir).decode


def _result(seq: Sequence, reason: str, started: float, now: float, step: int) -> dict:
    n = len(seq.output)
    first = seq.first_token_at
    return {"token_ids": seq.output, "finish_reason": reason,
            "metrics": {"ttft_s": first - started, "tpot_s": (now - first) / (n - 1) if n > 1 else 0.0,
                        "prompt_tokens": len(seq.request.prompt_token_ids), "output_tokens": n,
                        "queued_steps": seq.first_scheduled_step - seq.arrived_step,
                        "finished_step": step, "preemptions": seq.preemptions}}
