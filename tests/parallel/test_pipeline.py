"""Pipelined decode under PP: a micro-batch in every stage every tick, same tokens."""

import pytest
from reference import reference_tokens

from atoll import LLM, SamplingParams
from atoll.engine.rank.loop import run_batch
from atoll.engine.batch.lanes import Lanes
from atoll.engine.rank.runner import ModelRunner
from atoll.launch.local import run_local
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext

PROMPTS = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8], [250], [17, 18, 19, 20, 21, 22],
           [9, 8, 7], [60, 61, 62, 63], [2]]
NEW = 10


def _both_ways(rank, world, spec, requests):
    ctx = ParallelContext.create(Layout.parse(spec.layout), rank)
    runner = ModelRunner(spec, ctx)
    out = {}
    for pipelined in (True, False):
        results = run_batch(runner, requests, pipelined=pipelined)
        out[pipelined] = ([r["token_ids"] for r in results], dict(runner.stats))
    return ctx.pp.rank, out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["PP2", "PP3"])
def test_every_stage_works_every_tick(tiny_model, layout):
    d = tiny_model("llama", num_hidden_layers=6)
    llm = LLM(d, layout=layout, block_size=4, max_model_len=32, max_num_seqs=4)
    requests = llm.prepare(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    ranks = run_local(_both_ways, llm.layout.world_size, llm.spec(), requests, timeout_s=250)
    expected = reference_tokens(d, PROMPTS, NEW)
    pp = llm.layout.pp
    for stage, out in ranks:
        piped, (_, one) = out[True][1], out[False]
        assert out[True][0] == expected and out[False][0] == expected
        # one micro-batch at a time: each stage computes in one tick of every pp
        assert one["worked"] * pp <= one["ticks"] + pp
        # pp lanes: every stage computes in every tick but the pipeline's fill and drain
        assert piped["worked"] >= piped["ticks"] - 2 * (pp - 1), (stage, piped)
        # and the same tokens need fewer ticks: the lanes run side by side
        assert piped["ticks"] * 1.5 < one["ticks"], (piped, one)


def test_lanes_split_the_blocks_and_fall_back_to_one():
    lanes = Lanes(num_blocks=40, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                  max_model_len=32, depth=2)
    assert len(lanes) == 2
    firsts = [s.pool._free[0][-1] for s in lanes.schedulers]
    assert firsts == [0, 20] and all(s.pool.num_free == 20 for s in lanes.schedulers)
    assert [lanes.at(t) is lanes.schedulers[t % 2] for t in range(4)] == [True] * 4
    # 12 blocks hold one 32-token sequence (8 blocks) but not two: one lane, a slot every other tick
    one = Lanes(num_blocks=12, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                max_model_len=32, depth=2)
    assert len(one) == 1 and one.at(0) is one.schedulers[0] and one.at(1) is None


def test_a_cache_too_small_for_every_stage_warns(tiny_model):
    d = tiny_model("llama", num_hidden_layers=6)
    with pytest.warns(UserWarning, match="1 of 2 pipeline stages get a micro-batch"):
        LLM(d, layout="PP2", block_size=4, max_model_len=32, num_blocks=12)
