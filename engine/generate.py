"""The generation loop every rank runs in lock step: admit requests into free cache
slots, run one step over prefill and decode tokens together, stop finished sequences."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from atoll.engine.sampling import SamplerState, SamplingParams, sample
from atoll.layers.attention import AttentionMetadata


@dataclass
class Request:
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class Sequence:
    request: Request
    slot: int
    state: SamplerState
    output: list[int] = field(default_factory=list)
    cached: int = 0  # tokens already in the KV cache
    admitted_at: float = 0.0
    first_token_at: float | None = None

    def pending_tokens(self) -> list[int]:
        tokens = self.request.prompt_token_ids + self.output
        return tokens[self.cached:]

    def finish_reason(self, max_len: int) -> str | None:
        p = self.request.params
        last = self.output[-1]
        if last in p.stop_token_ids:
            return "stop"
        if len(self.output) >= p.max_tokens or len(self.request.prompt_token_ids) + len(self.output) >= max_len:
            return "length"
        return None


def run_requests(runner, requests: list[Request]) -> list[dict]:
    """Drive `runner.step` until every request is done; returns one result per request."""
    max_seqs, max_len = runner.spec.max_num_seqs, runner.spec.max_model_len
    pending = deque(requests)
    free = list(range(max_seqs))[::-1]
    active: list[Sequence] = []
    results: dict[int, dict] = {}
    while runner.any_work(bool(pending or active)):
        while pending and free:
            req = pending.popleft()
            active.append(Sequence(req, free.pop(), SamplerState(req.params), admitted_at=time.perf_counter()))
        chunks = [s.pending_tokens() for s in active]
        meta = AttentionMetadata.build([s.slot for s in active], [s.cached for s in active],
                                       [len(c) for c in chunks])
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long)
        tokens = runner.step(ids, meta, lambda logits: sample(logits, [s.state for s in active]))
        now = time.perf_counter()
        still = []
        for seq, chunk, token in zip(active, chunks, tokens.tolist()):
            seq.cached += len(chunk)
            seq.output.append(token)
            seq.first_token_at = seq.first_token_at or now
            reason = seq.finish_reason(max_len)
            if reason is None:
                still.append(seq)
                continue
            n = len(seq.output)
            results[seq.request.index] = {
                "token_ids": seq.output, "finish_reason": reason,
                "metrics": {"ttft_s": seq.first_token_at - seq.admitted_at,
                            "tpot_s": (now - seq.first_token_at) / (n - 1) if n > 1 else 0.0,
                            "prompt_tokens": len(seq.request.prompt_token_ids), "output_tokens": n},
            }
            free.append(seq.slot)
        active = still
    return [results[r.index] for r in requests]
