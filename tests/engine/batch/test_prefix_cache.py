"""Automatic prefix caching: the pool's named blocks (hash chain, sharing, reference counts,
LRU eviction), the scheduler that uses them, and greedy tokens identical with and without it
on real ranks (dense TP2 and PP2, MoE, under preemption)."""

import pytest
from reference import reference_tokens

from atoll import LLM, SamplingParams
from atoll.engine.kv.blocks import BlockPool, block_hash
from atoll.engine.batch.request import Request
from atoll.engine.sample.sampler import SamplerState
from atoll.engine.batch.scheduler import Scheduler, Sequence
from atoll.engine.rank.job import EngineJob
from atoll.engine.worker import worker
from atoll.launch.local import run_local


def _seq(i, prompt, max_tokens=3):
    req = Request(i, list(prompt), SamplingParams(max_tokens=max_tokens))
    return Sequence(req, SamplerState(req.params))


def _drive(sched, seqs):
    """Run the schedule as the engine would (token 7 each time); every chunk it schedules, in order."""
    for s in seqs:
        sched.add(s)
    chunks, step = [], 0
    while sched.has_work():
        for c in sched.schedule(step):
            chunks.append((c.seq.request.index, c.start, c.count))
            c.seq.cached = c.start + c.count
            if c.samples:
                c.seq.output.append(7)
                if len(c.seq.output) == c.seq.request.params.max_tokens:
                    sched.finish(c.seq)
        step += 1
        assert step < 1000
    return chunks


def test_hash_chain_names_the_whole_prefix():
    a = block_hash(None, [1, 2, 3, 4])
    assert a == block_hash(None, [1, 2, 3, 4])  # deterministic: hashlib, not hash()
    assert block_hash(a, [5, 6, 7, 8]) != block_hash(block_hash(None, [9, 2, 3, 4]), [5, 6, 7, 8])
    assert block_hash(None, [1, 2, 3, 4]) != block_hash(None, [1, 2, 3, 5])


def test_pool_shares_counts_and_evicts_least_recently_used():
    pool = BlockPool(4, 2)
    a, b = [], []
    assert pool.grow(a, 4) and a == [0, 1]
    names = [block_hash(None, [1, 2]), block_hash(block_hash(None, [1, 2]), [3, 4])]
    for block, name in zip(a, names):
        pool.name(block, name)
    assert pool.lookup(names) == [0, 1] and pool.lookup([block_hash(None, [9, 9])] + names) == []  # stops at a miss
    pool.share(b, pool.lookup(names[:1]))
    assert b == [0] and pool.num_free == 2
    pool.release(a)  # block 0 still held by b; block 1 named and unreferenced: evictable
    assert pool.num_free == 3 and pool.num_cached == 2
    c = []
    assert pool.grow(c, 4) and c == [2, 3]  # never-named blocks go first
    assert pool.num_cached == 2
    pool.release(b)
    d = []
    assert pool.grow(d, 2) and d == [1]  # then the least recently freed named block is evicted
    assert pool.lookup(names) == [0] and pool.evictions == 1
    pool.release(c), pool.release(d)
    assert pool.num_free == 4


def test_scheduler_skips_the_cached_prefix_and_frees_every_block():
    pool = BlockPool(32, 4)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64, prefix_caching=True)
    shared = list(range(100, 112))  # three full blocks
    first, second = _seq(0, shared + [1, 2]), _seq(1, shared + [3])
    _drive(sched, [first])
    chunks = _drive(sched, [second])
    assert chunks[0] == (1, 12, 1) and second.cached_tokens == 12
    # the whole prompt cached: the block of the last token is still computed, to sample
    third = _seq(2, shared)
    assert _drive(sched, [third])[0] == (2, 8, 4) and third.cached_tokens == 8
    assert pool.num_free == 32  # every block back when every request ended
    # blocks filled while decoding are named too: the first's prompt and its outputs 7, 7
    fourth = _seq(3, shared + [1, 2, 7, 7, 5])
    assert _drive(sched, [fourth])[0] == (3, 16, 1) and pool.num_free == 32


def test_off_means_no_sharing():
    sched = Scheduler(BlockPool(32, 4), max_num_seqs=4, max_num_batched_tokens=64)
    seqs = [_seq(0, list(range(1, 13))), _seq(1, list(range(1, 13)))]
    _drive(sched, seqs[:1])
    assert _drive(sched, seqs[1:])[0] == (1, 0, 12) and seqs[1].cached_tokens == 0


def test_preempted_sequence_finds_its_own_blocks_and_nothing_leaks():
    # 11 blocks of 4: four 20-token prompts cannot all grow, so the newest are preempted
    pool = BlockPool(11, 4)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64, prefix_caching=True)
    seqs = [_seq(i, [i + 1] * 4 + list(range(50, 66)), max_tokens=6) for i in range(4)]
    chunks = _drive(sched, seqs)
    assert sched.preemptions > 0
    resumed = [c for c in chunks if c[1] > 0 and c[2] > 1]  # a prefill that starts after cached blocks
    assert resumed, chunks
    assert all(len(s.output) == 6 for s in seqs)
    assert pool.num_free == 11


# --- identical greedy tokens on real ranks, with and without the cache ---

SYSTEM = [11, 23, 5, 67, 89, 12, 34, 56, 78, 90, 13, 24]  # 3 blocks of 4
PROMPTS = [SYSTEM + [3, 4, 5], SYSTEM + [7], SYSTEM + [8, 9, 10, 11, 12], SYSTEM, SYSTEM[:9] + [2, 2]]
NEW = 8


def _run(model_dir, layout, caching, num_blocks=None):
    llm = LLM(model_dir, layout=layout, block_size=4, num_blocks=num_blocks, max_model_len=32,
              max_num_batched_tokens=24, enable_prefix_caching=caching)
    requests = llm.prepare(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    for r, step in zip(requests, [0, 2, 2, 5, 9]):  # later arrivals find the first one's blocks
        r.arrival_step = step
    return run_local(worker, llm.layout.world_size, EngineJob.colocated(llm.spec()), requests=requests, timeout_s=250)[0]


@pytest.fixture(scope="module")
def dense(tiny_model):
    d = tiny_model("llama")
    return d, reference_tokens(d, PROMPTS, NEW)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout,num_blocks", [("TP2", None), ("PP2", None), ("TP2", 9)])  # 9 blocks: preemption
def test_same_tokens_with_and_without_the_cache(dense, layout, num_blocks):
    model_dir, expected = dense
    on, off = (_run(model_dir, layout, c, num_blocks) for c in (True, False))
    assert [r["token_ids"] for r in on] == [r["token_ids"] for r in off] == expected
    assert sum(r["metrics"]["cached_tokens"] for r in on) > 0
    assert all(r["metrics"]["cached_tokens"] == 0 for r in off)
    if num_blocks:
        assert sum(r["metrics"]["preemptions"] for r in on) > 0


@pytest.mark.timeout(400)
def test_same_tokens_moe(tiny_model):
    d = tiny_model("qwen3_moe")
    expected = reference_tokens(d, PROMPTS, NEW)
    on, off = (_run(d, "TP2", c) for c in (True, False))
    assert [r["token_ids"] for r in on] == [r["token_ids"] for r in off] == expected
    assert [r["metrics"]["cached_tokens"] for r in on][1:4] == [12, 12, 8]


def test_blocks_back_in_the_pool_when_requests_end(dense):
    from atoll.engine.rank.loop import run_batch
    from atoll.engine.rank.runner import ModelRunner
    from atoll.parallel.mesh import ParallelContext

    model_dir, expected = dense
    llm = LLM(model_dir, block_size=4, max_model_len=32)
    requests = llm.prepare(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    runner = ModelRunner(llm.spec(requests), ParallelContext.single())
    results = run_batch(runner, requests)
    assert [r["token_ids"] for r in results] == expected
    assert runner.stats["blocks_held"] == 0 and runner.stats["blocks_cached"] > 0


def test_cli_flag_turns_it_off():
    import argparse

    from atoll.config import EngineConfig, add_cli_options, from_args

    p = argparse.ArgumentParser()
    add_cli_options(p)
    assert from_args(p.parse_args([])).enable_prefix_caching is True
    assert from_args(p.parse_args(["--no-enable-prefix-caching"])).enable_prefix_caching is False
    assert EngineConfig().enable_prefix_caching is True


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compiled_decode_step_takes_a_cache_hit(dense, monkeypatch, tmp_path):
    """SYSTEM + [7] finds 12 cached tokens and arrives while request 0 decodes: its one-token
    chunk joins a decode micro-batch, which the compiled step runs."""
    from atoll.engine.rank.loop import run_batch
    from atoll.engine.rank.runner import ModelRunner
    from atoll.parallel.mesh import ParallelContext

    monkeypatch.delenv("ATOLL_ENFORCE_EAGER", raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("ATOLL_CACHE", str(tmp_path))
    monkeypatch.setenv("ATOLL_COMPILE", "always")  # compile at once, whatever a policy would weigh
    model_dir, expected = dense
    llm = LLM(model_dir, block_size=4, max_model_len=32, max_num_seqs=4)
    requests = llm.prepare(PROMPTS[:2], SamplingParams(max_tokens=NEW, ignore_eos=True))
    requests[1].arrival_step = 2
    runner = ModelRunner(llm.spec(requests), ParallelContext.single())
    # eager lifted, a dense model on the CPU (or CUDA): the step is always built, never skipped
    step = runner.decode_step
    assert step is not None
    ran = []  # (request, start, count) of every chunk the compiled step ran, one list a call
    call = type(step).__call__
    monkeypatch.setattr(type(step), "__call__", lambda self, x, mb: (
        ran.append([(c.seq.request.index, c.start, c.count) for c in mb.chunks]), call(self, x, mb))[1])
    results = run_batch(runner, requests)
    assert [r["token_ids"] for r in results] == expected[:2]
    assert results[1]["metrics"]["cached_tokens"] == 12
    # request 1's first chunk starts after its 12 cached tokens, beside request 0's decode, compiled
    hit = [batch for batch in ran if (1, 12, 1) in batch]
    assert len(hit) == 1 and len(hit[0]) == 2 and hit[0][0][0] == 0, ran
    assert step.buckets_run == [2]  # two sequences at most: the smallest bucket only
