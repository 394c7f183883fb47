"""A request as the ranks see it, when it ends, and the result it ends with."""

from __future__ import annotations

from dataclasses import dataclass, field

from atoll.config.sampling import SamplingParams


@dataclass
class Request:
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_step: int = 0  # the step at which it joins a fixed run (tests model late arrivals with it)
    # a copy of request `fork_of` (n > 1, engine.batch.copies): it waits for that request's
    # prompt to be computed and forks from it, instead of computing the prompt again
    fork_of: int | None = None
    # tokens it already generated on another engine (a migration, serve.replicas): they are
    # computed after the prompt, as its output so far, and it goes on from there
    generated: list[int] = field(default_factory=list)


def finish_reason(seq, max_len: int, decode=None) -> str | None:
    """"stop", "length" or None (not finished) after the sequence's last token."""
    p = seq.request.params
    if seq.output[-1] in p.stop_token_ids:
        return "stop"
    if p.stop and decode is not None and len(seq.output) > p.min_tokens:  # vLLM: not before min_tokens
        # every rank decodes the same tokens, so all agree; a stop string ends within the last
        # few tokens, and not within the first min_tokens
        text = decode(seq.output[max(p.min_tokens, len(seq.output) - 64):])
        if any(stop in text for stop in p.stop):
            return "stop"
    if len(seq.output) >= p.max_tokens or seq.length >= max_len:
        return "length"
    return None


def result_of(seq, reason: str, started: float, now: float, step: int) -> dict:
    n = len(seq.output)
    here = n - len(seq.request.generated)  # tokens made on this engine (a migrated request had some)
    first = seq.first_token_at
    ttft = (first - started) if first is not None else now - started
    return {"token_ids": seq.output, "finish_reason": reason,
            "metrics": {"ttft_s": ttft, "tpot_s": (now - first) / (here - 1) if first is not None and here > 1 else 0.0,
                        "prompt_tokens": len(seq.request.prompt_token_ids), "output_tokens": n,
                        "cached_tokens": seq.cached_tokens,
                        "queued_steps": (seq.first_scheduled_step - seq.arrived_step
                                         if seq.first_scheduled_step is not None else None),
                        "finished_step": step, "preemptions": seq.preemptions},
            **({"prompt_logprobs": [None] + seq.prompt_logprobs}
               if seq.request.params.prompt_logprobs is not None else {})}
