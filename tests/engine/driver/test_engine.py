"""The engine on real ranks: paged cache, late arrivals, preemption, a thousand requests."""

import resource

import pytest
import torch
from reference import reference_tokens

from atoll import LLM, SamplingParams
from atoll.engine.batch.request import Request
from atoll.engine.rank.loop import run_batch
from atoll.engine.rank.run_spec import RunSpec
from atoll.engine.rank.runner import ModelRunner
from atoll.engine.rank.job import EngineJob
from atoll.engine.worker import worker
from atoll.launch.local import run_local
from atoll.layers.attention import AttentionMetadata
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext

PROMPTS = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8], [250], [17, 18, 19, 20, 21, 22]]
NEW = 12


def _logits(model_dir, block_size):
    spec = RunSpec.of(str(model_dir), "TP1", max_model_len=64, block_size=block_size, max_num_seqs=3)
    runner = ModelRunner(spec, ParallelContext.single())
    prompts = [list(p) for p in PROMPTS[:3]]
    per_seq = -(-64 // block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(3)]
    if block_size < 64:
        tables = [t[::-1] for t in tables]  # blocks out of order: reads must follow the table
    outs = []
    with torch.inference_mode():
        meta = AttentionMetadata.build(tables, [0, 0, 0], [len(p) for p in prompts], block_size)
        logits = runner.model(torch.tensor(sum(prompts, [])), meta, runner.cache)
        for _ in range(4):
            outs.append(logits)
            nxt = logits.argmax(-1)
            meta = AttentionMetadata.build(tables, [len(p) for p in prompts], [1, 1, 1], block_size)
            for p, t in zip(prompts, nxt.tolist()):
                p.append(t)
            logits = runner.model(nxt, meta, runner.cache)
    return torch.stack(outs)


def test_paged_cache_gives_the_contiguous_logits(tiny_model):
    d = tiny_model("llama")
    contiguous = _logits(d, 64)  # one 64-token block per sequence
    paged = _logits(d, 4)
    # the padded key lengths differ, so reductions differ in the last bits only
    torch.testing.assert_close(paged, contiguous, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def model_and_reference(tiny_model):
    d = tiny_model("llama", num_hidden_layers=4)
    return d, reference_tokens(d, PROMPTS, NEW)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout,num_blocks", [("TP2", None), ("PP2", None), ("TP2PP2", None),
                                               ("TP2", 6)])  # 6 blocks of 4: forces preemption
def test_late_arrivals_match_transformers(model_and_reference, layout, num_blocks):
    model_dir, expected = model_and_reference
    llm = LLM(model_dir, layout=layout, block_size=4, num_blocks=num_blocks, max_model_len=24,
              max_num_batched_tokens=8)
    requests = llm.prepare(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    for r, step in zip(requests, [0, 0, 3, 7, 12]):
        r.arrival_step = step
    results = run_local(worker, llm.layout.world_size, EngineJob.colocated(llm.spec()), requests=requests, timeout_s=250)[0]
    assert [r["token_ids"] for r in results] == expected
    if num_blocks:
        assert sum(r["metrics"]["preemptions"] for r in results) > 0


def _thousand(rank, world, spec, requests):
    ctx = ParallelContext.create(Layout.parse(spec.layout), rank)
    runner = ModelRunner(spec, ctx)
    cache = [t.data_ptr() for t in runner.cache.k + runner.cache.v]
    first = run_batch(runner, requests[:100])
    rss_100 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rest = run_batch(runner, requests)
    rss_all = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    same_cache = cache == [t.data_ptr() for t in runner.cache.k + runner.cache.v]
    return first, rest, rss_100, rss_all, same_cache, runner.cache.bytes


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_thousand_requests_at_tp2(tiny_model):
    import random

    rng = random.Random(0)
    llm = LLM(tiny_model("llama"), layout="TP2", max_num_seqs=16, block_size=8, max_model_len=64)
    prompts = [[rng.randrange(1, 300) for _ in range(rng.randint(1, 30))] for _ in range(1000)]
    params = [SamplingParams(max_tokens=rng.randint(1, 10), ignore_eos=True) for _ in prompts]
    requests = llm.prepare(prompts, params)
    first, results, rss_100, rss_all, same_cache, cache_bytes = run_local(_thousand, 2, llm.spec(), requests,
                                                                          timeout_s=380)[0]
    assert len(results) == 1000
    for p, r in zip(params, results):
        assert len(r["token_ids"]) == p.max_tokens and r["finish_reason"] == "length"
    assert [r["token_ids"] for r in results[:100]] == [r["token_ids"] for r in first]
    # the cache is allocated once (the same tensors after 1000 requests), and the peak holds it
    # (ru_maxrss in KiB): 10x the requests may not grow the peak by more than 10%
    assert same_cache and rss_100 * 1024 > cache_bytes > 0
    assert rss_all <= rss_100 * 1.10, (rss_100, rss_all)
    # every request arrives at step 0, so queued_steps is the step it was admitted at: in order...
    queued = [r["metrics"]["queued_steps"] for r in results]
    assert queued == sorted(queued)
    # ...and each one holds a slot for at least its max_tokens steps
    assert all(r["metrics"]["finished_step"] - q >= p.max_tokens - 1 for p, r, q in zip(params, results, queued))
    # request i waits at least until i - 15 earlier ones have left the 16 slots: 16 x its queued
    # steps cover their slot-steps, at least the i - 15 smallest max_tokens among those ahead
    need = [sum(sorted(p.max_tokens for p in params[:i])[:i - 15]) if i > 15 else 0 for i in range(1000)]
    assert all(16 * q >= n for q, n in zip(queued, need)), [(i, q, n) for i, (q, n) in enumerate(zip(queued, need))
                                                           if 16 * q < n][:5]
    assert queued[999] >= -(-need[999] // 16) > 300  # ~985 requests of 5.5 tokens on average, 16 at a time
    # and at most for the waves ahead of it: a wave needs at most its prefill step and 10 tokens
    waves = [i // 16 for i in range(1000)]
    bound = max(waves) * (1 + 10 + 1) + 40
    assert max(queued) <= bound


def test_the_rank_loop_traces_each_tick_with_its_shape(tiny_model):
    """run_batch(trace=...): one (StepShape, seconds) per tick with work, the shapes adding up
    to the requests' prompt tokens and decode steps (what `atoll calibrate --steps` fits)."""
    spec = RunSpec.of(str(tiny_model("llama")), "TP1", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8)
    runner = ModelRunner(spec, ParallelContext.single())
    reqs = [Request(i, list(p), SamplingParams(max_tokens=NEW, ignore_eos=True)) for i, p in enumerate(PROMPTS[:3])]
    trace = []
    outs = run_batch(runner, reqs, trace=trace)
    assert all(len(o["token_ids"]) == NEW for o in outs)
    shapes = [s for s, *_ in trace]
    assert all(sec > 0 for _, sec, *_ in trace)
    assert sum(s.chunk_tokens for s in shapes) == sum(len(p) for p in PROMPTS[:3])  # prompts, chunked by 8
    assert sum(s.rows for s in shapes) == 3 * (NEW - 1)  # each later token is one decode row
    assert max(s.chunk_tokens for s in shapes) <= 8
    first = next(s for s in shapes if s.rows)
    assert first.ctx_sum >= first.rows  # a decode row attends to its context


@pytest.mark.parametrize("layout", ["TP1", "TP2"])
def test_step_trace_writes_each_engines_ticks_once(tiny_model, tmp_path, layout):
    """LLM(step_trace=FILE): the engine's first rank (of TP2's two, one) appends a line per tick
    with work, as the living engine serves; the ticks add up to the prompts and decode steps."""
    from atoll.engine.rank.trace import read_trace

    path = tmp_path / "ticks.jsonl"
    with LLM(str(tiny_model("llama")), layout=layout, max_num_seqs=4, max_num_batched_tokens=8,
             step_trace=str(path)) as llm:
        outs = llm.generate([list(p) for p in PROMPTS[:3]], SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert all(len(o.token_ids) == NEW for o in outs)
    ticks = [t for t in read_trace(path) if t[1] or t[2]]
    assert {t[0] for t in ticks} == {"engine"} and all(t[5] > 0 for t in ticks)
    assert sum(t[2] for t in ticks) == sum(len(p) for p in PROMPTS[:3])  # every prompt token once: one rank wrote
    assert sum(t[1] for t in ticks) == 3 * (NEW - 1)
    # a decode tick's padded keys: its rows, each a power of two of 16-token blocks
    for t in ticks:
        if t[1] and not t[2]:
            assert t[6] >= t[3] and (t[6] / t[1]) % 16 == 0 and t[7] in (True, False)
