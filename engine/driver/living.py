"""What the LLM API needs of a living engine: the spec its ranks are built with (a context of
the model's length and a cache for max_num_seqs of them, not one run's requests), and a list
of requests run through it to the end."""

from __future__ import annotations

import threading
import time

import torch

from atoll.engine.kv.sizing import available_memory
from atoll.engine.kv.sizing import cpu_blocks
from atoll.engine.driver.online import EngineDead
from atoll.engine.batch.copies import expand, gather
from atoll.engine.batch.request import Request
from atoll.engine.rank.run_spec import RunSpec, resolve_dtype
from atoll.errors import LaunchError
from atoll.engine.kv.sizing import kv_bytes_per_block

CPU_CACHE_SHARE = 0.25  # of the machine's available memory, shared by its ranks, at most for the KV cache


def lane_load(requests: list[Request], layout, max_num_seqs: int) -> tuple[int, int]:
    """(sequences a lane runs at once, decode steps each rank expects) for these requests:
    each DP replica and pipeline lane takes its share; the compile policy weighs the steps."""
    seqs = min(max_num_seqs, -(-len(requests) // (layout.pp * layout.dp)))
    return seqs, -(-sum(r.params.max_tokens - 1 for r in requests) // (layout.dp * seqs))


def engine_spec(llm, requests: list[Request] | None = None) -> RunSpec:
    """The spec of a living engine. On the CPU, without --num-blocks or --kv-cache-gb, its
    cache holds max_num_seqs sequences of max_model_len per pipeline lane, or what a quarter
    of the available memory holds when that is less (the ranks share it). `requests`, when
    the first call knows them, tell the compile policy how much decoding is coming."""
    o, layout = llm.options, llm.layout
    steps = lane_load(requests, layout, llm.max_num_seqs)[1] if requests else None
    spec = RunSpec(str(llm.model_dir), str(layout), o, max_model_len=llm.max_model_len,
                   max_num_batched_tokens=llm.max_num_batched_tokens, decode_steps=steps)
    on_cpu = o.device == "cpu" or not torch.cuda.is_available()
    if on_cpu and o.num_blocks is None and o.kv_cache_gb is None:
        per_block = kv_bytes_per_block(llm.config, layout, resolve_dtype(o.dtype, llm.config, torch.device("cpu")).itemsize,
                                       o.block_size, kv_cache_dtype=o.kv_cache_dtype)
        need = cpu_blocks(block_size=o.block_size, max_num_seqs=o.max_num_seqs, max_model_len=llm.max_model_len,
                          lanes=layout.pp, cp=layout.cp)
        cap = int(available_memory() * CPU_CACHE_SHARE / layout.world_size) // per_block
        if need > cap:
            spec = spec.with_engine(num_blocks=max(cap, 1))
    return spec


def run_through(engine, requests: list[Request], *, timeout_s: float | None = None, on_result=None,
                on_step=None, errors: dict | None = None, share: bool = True) -> list[dict]:
    """Every request through a living engine; one result per request, in order (a request of
    n > 1 runs as n copies, engine.batch.copies, and its result is their gather; `share`: the
    copies fork from the first one's prompt). on_result(k, result) as request k ends;
    on_step(done, tokens) as tokens arrive. A request that fails raises EngineDead with its
    line once every request has ended; given `errors`, a request that fails while the engine
    serves on (a disaggregated job's dead engine) puts its line in errors[k] instead and its
    result is None (the whole engine dying still raises)."""
    results: dict[int, dict] = {}
    parts: dict[int, dict[int, dict]] = {}  # request -> copy -> its result
    logprobs: dict[tuple, list] = {}
    prompt_logprobs: dict[tuple, list] = {}
    ended: set[int] = set()  # requests finished or failed
    failure: list[str] = []
    all_done = threading.Event()
    counts = {"tokens": 0}
    lock = threading.Lock()
    engine_requests, groups = expand(requests, engine.new_id, share=share)

    def sink_for(k: int, j: int):
        def sink(kind: str, payload) -> None:
            result = None
            with lock:
                if kind == "token":
                    counts["tokens"] += 1
                    if payload[1] is not None:
                        logprobs.setdefault((k, j), []).append(payload[1])
                    if len(payload) > 2 and payload[2] is not None:
                        prompt_logprobs[k, j] = payload[2]
                elif kind == "finish":
                    extra = {"logprobs": logprobs.pop((k, j))} if (k, j) in logprobs else {}
                    if (k, j) in prompt_logprobs:
                        extra["prompt_logprobs"] = prompt_logprobs.pop((k, j))
                    parts.setdefault(k, {})[j] = payload | extra
                    if len(parts[k]) == len(groups[k]) and k not in ended:
                        result = results[k] = gather([parts[k][c] for c in range(len(groups[k]))])
                        ended.add(k)
                elif k not in ended:
                    ended.add(k)
                    if errors is not None:
                        errors[k] = payload
                    else:
                        failure.append(payload)
                done = len(ended) >= len(requests)
            if result is not None and on_result is not None:
                on_result(k, result)
            if on_step is not None and kind != "error":
                on_step(len(results), counts["tokens"])
            if done:
                all_done.set()
        return sink

    pairs = []
    for k, group in enumerate(groups):
        for j, position in enumerate(group):
            pairs.append((engine_requests[position], sink_for(k, j)))
    engine.submit_all(pairs)  # all at once: they join at one tick
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not all_done.wait(0.2):
        if deadline is not None and time.monotonic() > deadline:
            for req in engine_requests:
                engine.abort(req.index)
            raise LaunchError(f"timed out after {timeout_s:.0f}s with {len(requests) - len(results)} requests "
                              "unfinished")
    if failure:
        raise EngineDead(failure[0])
    if errors and engine.error is not None:
        raise EngineDead(engine.error)
    return [results.get(k) for k in range(len(requests))]
