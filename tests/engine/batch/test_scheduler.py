"""The scheduler and block pool alone: budgets, preemption, fairness, no leaked blocks."""

import random

from atoll.engine.kv.blocks import BlockPool
from atoll.engine.batch.request import Request
from atoll.engine.sample.sampler import SamplerState, SamplingParams
from atoll.engine.batch.scheduler import Scheduler, Sequence


def _seq(i, prompt_len, arrived=0):
    req = Request(i, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=4))
    return Sequence(req, SamplerState(req.params), arrived_step=arrived)


def _drive(sched, seqs, max_steps=10_000, out_len=4):
    """Run the schedule as the engine would, sampling token 7 each time; returns finish steps."""
    for s in seqs:
        sched.add(s)
    done, step = {}, 0
    while sched.has_work():
        chunks = sched.schedule(step)
        assert sum(c.count for c in chunks) <= sched.budget
        assert len(sched.running) <= sched.max_num_seqs
        held = sum(len(s.blocks) for s in sched.running)
        assert held + sched.pool.num_free == sched.pool.num_blocks  # no block lost or shared
        for c in chunks:
            assert len(c.seq.blocks) * sched.pool.block_size >= c.start + c.count
            c.seq.cached = c.start + c.count
            if c.samples:
                c.seq.output.append(7)
                if len(c.seq.output) == out_len:
                    sched.finish(c.seq)
                    done[c.seq.request.index] = step
        step += 1
        assert step < max_steps, "the schedule stopped making progress"
    return done


def test_budget_and_chunked_prefill():
    sched = Scheduler(BlockPool(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    seqs = [_seq(0, 25), _seq(1, 3), _seq(2, 12)]
    done = _drive(sched, seqs)
    assert set(done) == {0, 1, 2}
    assert sched.pool.num_free == 64
    assert all(len(s.output) == 4 for s in seqs)


def test_preemption_recomputes_and_nothing_starves():
    # 11 blocks of 4 tokens: two 20-token sequences (5 blocks each) cannot both grow to 6 blocks
    sched = Scheduler(BlockPool(11, 4), max_num_seqs=4, max_num_batched_tokens=64)
    seqs = [_seq(i, 20) for i in range(4)]
    done = _drive(sched, seqs)
    assert set(done) == {0, 1, 2, 3}
    assert sched.preemptions > 0
    assert sched.pool.num_free == 11
    # the oldest request is never the one preempted, so it finishes first
    assert done[0] == min(done.values())


def test_fifo_admission_bounds_waiting():
    rng = random.Random(0)
    sched = Scheduler(BlockPool(200, 4), max_num_seqs=5, max_num_batched_tokens=32)
    seqs = [_seq(i, rng.randint(1, 12)) for i in range(60)]
    _drive(sched, seqs)
    first = [s.first_scheduled_step for s in seqs]
    assert first == sorted(first)  # admitted strictly in arrival order
    # each admission wave waits at most for the wave ahead of it to finish its prefill and 4 tokens
    per_wave = 12 + 4
    assert max(first) <= (len(seqs) // 5 + 1) * per_wave
